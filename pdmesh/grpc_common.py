"""Plumbing every pdmesh gRPC process shares: one place, so all services behave alike.

- `TLSConfig` + `server_credentials` / `channel_credentials`: TLS from PEM files; with a CA the
  server *requires* client certificates (mutual TLS).
- `server_options` / `channel_options`: message size limits on both ends of every hop.
- `GrpcServer`: a `grpc.aio` server with the standard health service and server reflection.
- `refuse` / `refused_reason`: the refused-before-work marker another instance may retry.
- `GrpcServer.drain`: graceful drain (`pdmesh.drain`): NOT_SERVING, refuse new work, let the
  running calls end.
- `install_shutdown_signals`: SIGINT/SIGTERM set an asyncio.Event; the service drains on it,
  and a watchdog bounds how long the process may outlive its drain.

Configuration parsing is `pdmesh.config`; an engine's Redis presence is `pdmesh.engine_svc`.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import signal
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdmesh.auth import ClusterToken, client_interceptors, server_interceptors
from pdmesh.drain import DrainGate, Refusal
from pdmesh.request_decoding import RequestDecoding

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20
"""Large enough for a long prompt's logprobs; KV bytes never travel over gRPC messages."""


# -- TLS -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TLSConfig:
    """PEM file paths. cert+key enable TLS; adding ca makes it mutual (client certs required
    on servers, server verified against ca on clients)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    def validate(self, *, server: bool) -> None:
        """Raise ValueError naming the flag when the combination or a file is wrong."""
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if server and self.ca and not self.cert:
            raise ValueError("--tls-ca on a server needs --tls-cert and --tls-key")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key),
                           ("--tls-ca", self.ca)):
            if path and not Path(path).is_file():
                raise ValueError(f"{flag}: no such file {path!r}")


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials | None:
    """None = plaintext. With a CA, clients must present a certificate signed by it."""
    if not tls.enabled:
        return None
    tls.validate(server=True)
    return grpc.ssl_server_credentials(
        [(_read(tls.key), _read(tls.cert))],
        root_certificates=_read(tls.ca),
        require_client_auth=bool(tls.ca),
    )


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials | None:
    """None = plaintext. ca verifies the server; cert+key are this client's identity."""
    if not tls.enabled:
        return None
    tls.validate(server=False)
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca),
        private_key=_read(tls.key),
        certificate_chain=_read(tls.cert),
    )


# -- channels and servers --------------------------------------------------------------------------
def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),  # two servers must never share a port by accident
    ]


RECONNECT_BACKOFF_MS = (250, 2000)
"""(first, longest) wait before a channel reconnects. gRPC's defaults (1 s growing to 120 s)
suit far-away servers; every peer of ours is one hop away and restarted within seconds by its
supervisor (`pdmesh serve`, Kubernetes), and a gateway or router still backing off after the
peer is back serves 503s for nothing."""


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    first, longest = RECONNECT_BACKOFF_MS
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", first),
        ("grpc.min_reconnect_backoff_ms", first),
        ("grpc.max_reconnect_backoff_ms", longest),
    ]


def open_channel(
    target: str,
    tls: TLSConfig | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    token: ClusterToken | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel to `target`, TLS when `tls` is enabled; every call carries the
    cluster `token` when one is given (`pdmesh.auth`)."""
    creds = channel_credentials(tls) if tls is not None else None
    options = channel_options(max_message_bytes)
    interceptors = client_interceptors(token)
    if creds is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(target, creds, options=options, interceptors=interceptors)


class GrpcServer:
    """A `grpc.aio` server with health and reflection already wired.

    Usage: create, add servicers to `.server` (with `add_XServicer_to_server`), `await start()`,
    later `await stop()`. `service_names` are the full names (`pdmesh.v1.Prefill`) to report in
    health and reflection. With a cluster `token`, every call but health checks must carry it
    (UNAUTHENTICATED otherwise; `pdmesh.auth`).
    """

    def __init__(
        self,
        service_names: Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: TLSConfig | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        token: ClusterToken | None = None,
        drain_methods: Collection[str] = (),
        refusal: Refusal | None = None,
    ) -> None:
        self.gate = DrainGate(drain_methods, refusal or refuse_draining)
        self.server = grpc.aio.server(options=server_options(max_message_bytes),
                                      interceptors=[*server_interceptors(token), self.gate,
                                                    RequestDecoding()])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._services = list(service_names)
        reflection.enable_server_reflection(
            [*self._services, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self._host = host
        self._port = port
        self._tls = tls or TLSConfig()
        self.port = 0

    @property
    def address(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self.port}"

    async def start(self) -> str:
        """Bind, start and mark every service SERVING; returns `host:port` actually bound."""
        target = f"{self._host}:{self._port}"
        creds = server_credentials(self._tls)
        if creds is None:
            self.port = self.server.add_insecure_port(target)
        else:
            self.port = self.server.add_secure_port(target, creds)
        if self.port == 0:
            raise OSError(f"could not bind gRPC server to {target}")
        await self.server.start()
        await self.set_serving(True)
        return self.address

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self._services]:
            await self.health.set(name, status)

    async def begin_drain(self) -> None:
        """Report NOT_SERVING and refuse new calls of the `drain_methods` (with `refusal`);
        the running ones go on (see `pdmesh.drain`)."""
        await self.set_serving(False)
        self.gate.close()

    async def drain(self, timeout_s: float) -> int:
        """`begin_drain`, then wait up to `timeout_s` for the running calls to end; returns how
        many still run. The server stays up: `stop()` comes after."""
        await self.begin_drain()
        return await self.gate.wait_idle(timeout_s)

    async def stop(self, grace_s: float = 2.0) -> None:
        """Report NOT_SERVING, then stop; calls still running after `grace_s` are cancelled."""
        with contextlib.suppress(Exception):
            await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


# -- refusals another instance can take ----------------------------------------------------------
REFUSED_KEY = "pdmesh-refused"
"""Trailing metadata an engine servicer sets when it refuses a call *before doing any work for
it* (draining, KV pull failed on the sender's side, ...): the router may send the request to
another instance. Its value is the reason, a metric label. Without it the router only retries
gRPC's own transport failures; an instance's other errors are answers, not retryable."""

KV_LOAD_FAILED = "kv_load_failed"
"""Refusal reason of a Decode whose KV pull failed (`--kv-load-failure-policy fail`): the fault
is the *prefill* instance's, so the router charges that one, not the decode instance."""


DRAINING = "draining"
"""Refusal reason of a call that reached an instance draining before shutdown."""


async def refuse(context: grpc.aio.ServicerContext, reason: str, message: str) -> None:
    """Abort with UNAVAILABLE marked as refused-before-work (raises, like `context.abort`)."""
    context.set_trailing_metadata(((REFUSED_KEY, reason),))
    await context.abort(grpc.StatusCode.UNAVAILABLE, message)


async def refuse_draining(context: grpc.aio.ServicerContext) -> None:
    """`GrpcServer`'s default refusal while draining: another instance may take the call."""
    await refuse(context, DRAINING, "instance is draining before shutdown; try another")


def refused_reason(error: grpc.aio.AioRpcError) -> str | None:
    """The reason of a call refused with `refuse()`, or None."""
    for key, value in error.trailing_metadata() or ():
        if key == REFUSED_KEY:
            return str(value)
    return None


TEARDOWN_BOUND_S = 10.0
"""How long a process may take, after its drain deadline, to close its server, channels and
connections. Teardown is normally well under a second; past this it is stuck somewhere. Below
the chart's 15 s margin (`_drain.tpl`), so the watchdog's stack dump comes before the kubelet's
SIGKILL."""


def install_shutdown_signals(stop: asyncio.Event, drain_timeout_s: float | None = None) -> None:
    """SIGINT/SIGTERM set `stop` (once); the service's main coroutine drains on it.

    With `drain_timeout_s`, the first signal also arms a watchdog: a process still alive
    `drain_timeout_s + TEARDOWN_BOUND_S` later writes every thread's stack to stderr and exits
    with status 1. A shutdown stuck in a library (a channel close, an executor join) then shows
    where, and never holds a port, a GPU or a pod's termination beyond its deadline. The
    watchdog is faulthandler's own thread, so it fires even if the event loop is blocked.
    """
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            return
        stop.set()
        if drain_timeout_s is not None:
            bound = drain_timeout_s + TEARDOWN_BOUND_S
            logger.info("%s: draining; exit forced after %gs", sig.name, bound)
            arm_exit_watchdog(bound)
            # Before it: which coroutines are still waiting, if the loop itself still turns
            # (a thread dump shows only an idle loop then).
            loop.call_later(max(0.0, bound - TASK_DUMP_LEAD_S), dump_tasks)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)


TASK_DUMP_LEAD_S = 2.0
"""How long before the exit watchdog fires the pending coroutines are written out."""


def dump_tasks(file: Any = None) -> None:
    """Every pending asyncio task's stack to stderr: where a stuck shutdown awaits."""
    out = file or sys.stderr
    tasks = [t for t in asyncio.all_tasks() if not t.done()]
    print(f"shutdown still waiting on {len(tasks)} asyncio task(s):", file=out)
    for task in tasks:
        print(f"-- {task.get_name()}: {task.get_coro()!r}", file=out)
        task.print_stack(file=out)
    out.flush()


async def await_bounded(what: str, awaitable: Any, timeout_s: float) -> bool:
    """Await one teardown step for at most `timeout_s`; past it, log which step is stuck and
    go on without it (it is left running, not awaited again: a step that swallows its
    cancellation would hang `wait_for` too). True when it finished in time."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        logger.warning("shutdown: %s did not finish within %gs; going on without it", what,
                       timeout_s)
        task.print_stack(file=sys.stderr)
        return False
    if not task.cancelled() and task.exception() is not None:
        logger.warning("shutdown: %s failed: %r", what, task.exception())
    return True


def arm_exit_watchdog(after_s: float) -> None:
    """In `after_s` seconds: every thread's stack to stderr, then `_exit(1)` (faulthandler)."""
    faulthandler.dump_traceback_later(after_s, repeat=False, file=sys.stderr, exit=True)
