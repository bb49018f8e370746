"""Internal authentication with a shared cluster token (works with or without a CA).

Every process of one mesh holds the same secret token. It is read from a file
(`--cluster-token-file`, e.g. a mounted Kubernetes Secret) or the `PDMESH_CLUSTER_TOKEN`
environment variable — never from a command-line value, which `ps` would show. `pdmesh serve`
generates one per run and hands it to its children through the environment.

What it protects (see docs/SECURITY.md):

* the internal gRPC services (Prefill, Decode, KV transfer control) refuse calls that do not
  carry the token (`ClusterTokenInterceptor`, UNAUTHENTICATED); the standard health service
  stays open so probes keep working;
* registry entries and per-transfer capabilities are HMACs keyed with it (`ClusterToken.sign`),
  so nobody without the token can announce an instance or pull a transfer routed elsewhere.

Comparisons are constant-time (`hmac.compare_digest`). Over plaintext the token travels in
call metadata, so it keeps out processes that merely *reach* a port, not an on-path
eavesdropper: use TLS for that.

Rotation without downtime: the file (or variable) may hold several whitespace-separated
tokens. The first is *used* (sent, signs); every one is *accepted*. Roll out "old new", then
"new old", then "new" (docs/SECURITY.md).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter

from pdmesh.metrics import _once, metric_name

logger = logging.getLogger(__name__)

TOKEN_ENV = "PDMESH_CLUSTER_TOKEN"
TOKEN_FILE_ENV = "PDMESH_CLUSTER_TOKEN_FILE"
METADATA_KEY = "pdmesh-cluster-token"
MIN_TOKEN_CHARS = 16
OPEN_METHOD_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/",)
"""Methods callable without the token: health probes (kubelet, load balancers)."""


class TokenError(ValueError):
    """The configured token is unusable (empty, too short, unreadable file)."""


@dataclass(frozen=True)
class ClusterToken:
    """The shared secret (`value`, used) and, during a rotation, others still accepted.
    Its repr never shows them."""

    value: str = field(repr=False)
    also_accepted: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        for value in (self.value, *self.also_accepted):
            if len(value) < MIN_TOKEN_CHARS:
                raise TokenError(f"a cluster token must have at least {MIN_TOKEN_CHARS} "
                                 f"characters, got {len(value)}")
            if not value.isascii() or not value.isprintable() or " " in value:
                raise TokenError("a cluster token must be printable ASCII without spaces "
                                 "(it travels as gRPC metadata)")

    @classmethod
    def generate(cls) -> ClusterToken:
        return cls(secrets.token_urlsafe(32))

    @classmethod
    def parse(cls, text: str) -> ClusterToken | None:
        """Whitespace-separated tokens, the used one first; None if there are none."""
        values = text.split()
        return cls(values[0], tuple(values[1:])) if values else None

    @property
    def _accepted(self) -> tuple[str, ...]:
        return (self.value, *self.also_accepted)

    def matches(self, presented: str | bytes | None) -> bool:
        """Constant-time comparison with what a caller presented."""
        if presented is None:
            return False
        if isinstance(presented, str):
            presented = presented.encode("ascii", "replace")
        hits = [hmac.compare_digest(presented, v.encode()) for v in self._accepted]
        return any(hits)

    def sign(self, purpose: str, *fields: str) -> str:
        """HMAC-SHA256 (hex) over `fields`, domain-separated by `purpose`, with the used token.

        Each field is length-prefixed, so ("ab", "c") and ("a", "bc") sign differently.
        """
        return _sign(self.value, purpose, fields)

    def verify(self, mac: str, purpose: str, *fields: str) -> bool:
        """Constant-time check of a `sign` result made with any accepted token."""
        if not isinstance(mac, str) or not mac:
            return False
        presented = mac.encode("ascii", "replace")
        hits = [hmac.compare_digest(presented, _sign(v, purpose, fields).encode())
                for v in self._accepted]
        return any(hits)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata that authenticates a client."""
        return ((METADATA_KEY, self.value),)


def _sign(key: str, purpose: str, fields: tuple[str, ...]) -> str:
    mac = hmac.new(key.encode(), digestmod=hashlib.sha256)
    for part in (purpose, *fields):
        data = part.encode()
        mac.update(len(data).to_bytes(4, "big") + data)
    return mac.hexdigest()


def load_cluster_token(
    path: str | None = None, env: Mapping[str, str] | None = None
) -> ClusterToken | None:
    """The token from `path`, else `$PDMESH_CLUSTER_TOKEN_FILE`, else `$PDMESH_CLUSTER_TOKEN`;
    None when none is configured (the mesh then runs without internal authentication)."""
    env = os.environ if env is None else env
    path = path or env.get(TOKEN_FILE_ENV) or None
    if path:
        try:
            raw = Path(path).read_text().strip()
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise TokenError(f"--cluster-token-file: cannot read {path!r}: {exc}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO) and not _is_k8s_secret(path):
            logger.warning("cluster token file %s is readable by group/others; chmod 600 it",
                           path)
        token = ClusterToken.parse(raw)
        if token is None:
            raise TokenError(f"--cluster-token-file: {path!r} is empty")
        return token
    return ClusterToken.parse(env.get(TOKEN_ENV, ""))


def _is_k8s_secret(path: str) -> bool:
    """Kubernetes mounts Secrets through symlinks into `..data`; their mode is set by the pod
    spec (defaultMode), so a group bit there is the operator's choice, not an accident."""
    return "..data" in os.path.realpath(path)


# -- metrics -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class AuthMetrics:
    refused_calls: Counter   # internal calls refused for lack of the token, by reason
    registry_rejected: Counter  # registry entries the router would not route to, by reason


def _build(r: CollectorRegistry) -> AuthMetrics:
    return AuthMetrics(
        refused_calls=Counter(metric_name("auth_refused_calls"),
                              "Internal gRPC calls refused: missing or wrong cluster token",
                              ["reason"], registry=r),
        registry_rejected=Counter(metric_name("registry_rejected_entries"),
                                  "Registry entries not routed to: unsigned or forged",
                                  ["reason"], registry=r),
    )


def auth_metrics(registry: CollectorRegistry | None = None) -> AuthMetrics:
    return _once("auth", registry, _build)


# -- server side -------------------------------------------------------------------------------
class ClusterTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call without the cluster token, except health checks."""

    def __init__(self, token: ClusterToken, *,
                 open_prefixes: Sequence[str] = OPEN_METHOD_PREFIXES) -> None:
        self._token = token
        self._open = tuple(open_prefixes)
        self._metrics = auth_metrics()
        self._logged: set[tuple[str, str]] = set()  # (method, reason) warned about once

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or method.startswith(self._open):
            return handler
        presented = None
        for key, value in details.invocation_metadata or ():
            if key == METADATA_KEY:
                presented = value
        if self._token.matches(presented):
            return handler
        reason = "missing" if presented is None else "invalid"
        self._metrics.refused_calls.labels(reason).inc()
        # Once per method and reason at warning level: a scanner must not flood the log (the
        # metric counts every refusal). Only served methods get here, so the set is bounded.
        level = logging.DEBUG if (method, reason) in self._logged else logging.WARNING
        self._logged.add((method, reason))
        logger.log(level, "refused %s: %s cluster token", method, reason)
        return _refusal(handler, f"{reason} cluster token")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    serde = {"request_deserializer": handler.request_deserializer,
             "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **serde)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **serde)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **serde)
    return grpc.unary_unary_rpc_method_handler(refuse, **serde)


def server_interceptors(token: ClusterToken | None) -> list[grpc.aio.ServerInterceptor]:
    return [] if token is None else [ClusterTokenInterceptor(token)]


# -- client side -------------------------------------------------------------------------------
class _ClientToken:
    """Adds the token to the metadata of every call on a channel."""

    def __init__(self, token: ClusterToken) -> None:
        self._metadata = token.metadata()

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials,
            details.wait_for_ready,
        )


# grpc.aio files each interceptor under the *first* call kind it implements, so every kind
# needs its own class.
class _UnaryUnary(_ClientToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _UnaryStream(_ClientToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamUnary(_ClientToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any,
                                     request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_ClientToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any,
                                      request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


def client_interceptors(token: ClusterToken | None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add `token` to every call of a `grpc.aio` channel ([] for None)."""
    if token is None:
        return []
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
