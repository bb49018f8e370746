"""Plumbing every pdmesh gRPC process shares: one place, so all services behave alike.

- `TLSConfig` + `server_credentials` / `channel_credentials`: TLS from PEM files; with a CA the
  server *requires* client certificates (mutual TLS).
- `server_options` / `channel_options`: message size limits on both ends of every hop.
- `GrpcServer`: a `grpc.aio` server with the standard health service and server reflection.
- `install_shutdown_signals`: SIGINT/SIGTERM set an asyncio.Event; the service drains on it.
- `ClusterPresence`: registers the instance in Redis, heartbeats its load and publishes its KV
  events to the prefix index. Redis being down is logged, reported (`registered`, health name
  `PRESENCE_HEALTH_NAME`) and retried with a jittered back-off, never fatal: serving traffic
  matters more than being indexed.
- `parse_config`: one dataclass per component, filled from defaults < PDMESH_<FIELD> env vars <
  CLI flags, so every service reads its configuration the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import signal
import types
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdmesh.engine.kv_events import KVEvent, KVEventBatch
from pdmesh.kvstore.instance_registry import InstanceInfo, InstanceRegistry, SchemeMismatchError
from pdmesh.kvstore.prefix_index import PrefixIndex
from pdmesh.kvstore.redis_conn import IndexUnavailable, RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20
"""Large enough for a long prompt's logprobs; KV bytes never travel over gRPC messages."""

C = TypeVar("C")


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


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def open_channel(
    target: str,
    tls: TLSConfig | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> grpc.aio.Channel:
    """An asyncio channel to `target`, TLS when `tls` is enabled."""
    creds = channel_credentials(tls) if tls is not None else None
    options = channel_options(max_message_bytes)
    if creds is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, creds, options=options)


class GrpcServer:
    """A `grpc.aio` server with health and reflection already wired.

    Usage: create, add servicers to `.server` (with `add_XServicer_to_server`), `await start()`,
    later `await stop()`. `service_names` are the full names (`pdmesh.v1.Prefill`) to report in
    health and reflection.
    """

    def __init__(
        self,
        service_names: Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: TLSConfig | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.server = grpc.aio.server(options=server_options(max_message_bytes))
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


async def refuse(context: grpc.aio.ServicerContext, reason: str, message: str) -> None:
    """Abort with UNAVAILABLE marked as refused-before-work (raises, like `context.abort`)."""
    context.set_trailing_metadata(((REFUSED_KEY, reason),))
    await context.abort(grpc.StatusCode.UNAVAILABLE, message)


def refused_reason(error: grpc.aio.AioRpcError) -> str | None:
    """The reason of a call refused with `refuse()`, or None."""
    for key, value in error.trailing_metadata() or ():
        if key == REFUSED_KEY:
            return str(value)
    return None


def install_shutdown_signals(stop: asyncio.Event) -> None:
    """SIGINT/SIGTERM set `stop` (once); the service's main coroutine drains on it."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


# -- cluster presence (registry + prefix index) ----------------------------------------------------
LoadFn = Callable[[], Mapping[str, float]]
EventsFn = Callable[[], Awaitable[list[KVEvent]]]
SnapshotFn = Callable[[], Awaitable[list[KVEvent]]]
PresenceChangeFn = Callable[[bool, str], Awaitable[None]]
"""Called with (registered, detail) whenever `ClusterPresence.registered` flips."""

PRESENCE_HEALTH_NAME = "pdmesh.engine.ClusterIndex"
"""Health-service name an engine reports SERVING while it is registered and publishing to the
Redis index, NOT_SERVING while it is not. Only informational: the engine's own services stay
SERVING, because a request routed to it is served just the same without the index."""


@dataclass
class Backoff:
    """Retry delays while Redis is unreachable: `initial_s` doubling up to `max_s`, each drawn
    from [delay/2, delay] so engines that lost Redis together do not retry in lockstep."""

    initial_s: float = 0.5
    max_s: float = 5.0
    rng: random.Random = dataclasses.field(default_factory=random.Random, repr=False)
    _attempt: int = dataclasses.field(default=0, init=False, repr=False)

    def next_delay(self) -> float:
        nominal = min(self.max_s, self.initial_s * 2.0 ** self._attempt)
        self._attempt = min(self._attempt + 1, 32)  # 2**32 * initial is past any sane max
        return nominal / 2 + self.rng.uniform(0.0, nominal / 2)

    def reset(self) -> None:
        self._attempt = 0


class ClusterPresence:
    """Keeps one instance registered, heartbeating and indexed in Redis.

    `load()` gives the heartbeat's load figures. `take_events()` drains new KV events;
    `snapshot()` drains them too and returns a batch describing *everything* cached (sent after
    (re-)registration and after a lost batch). `events_ready` wakes the loop early so events
    reach the index within `publish_interval_s` instead of a heartbeat later.

    A hash-scheme mismatch is fatal and surfaces via `fatal`. Every other Redis failure is an
    outage: `registered` turns False (`on_change` is told), events are dropped (the snapshot
    sent on return covers them) and Redis is retried with `backoff`, never in a tight loop.
    When Redis answers again the instance heartbeats — or registers anew if Redis lost it, e.g.
    after a restart with an empty dataset — and republishes a full snapshot.
    """

    def __init__(
        self,
        conn: RedisConnection,
        info: InstanceInfo,
        *,
        load: LoadFn,
        take_events: EventsFn,
        snapshot: SnapshotFn,
        events_ready: asyncio.Event | None = None,
        ttl_s: float = 10.0,
        publish_interval_s: float = 0.05,
        backoff: Backoff | None = None,
        on_change: PresenceChangeFn | None = None,
    ) -> None:
        self.info = info
        self._conn = conn
        keys = KeySpace(model=info.model)
        self._registry = InstanceRegistry(conn, keys, ttl_s=ttl_s)
        self._index = PrefixIndex(conn, keys)
        self._load = load
        self._take_events = take_events
        self._snapshot = snapshot
        self._events_ready = events_ready or asyncio.Event()
        self._heartbeat_s = ttl_s / 3
        self._publish_s = publish_interval_s
        self._backoff = backoff or Backoff()
        self._on_change = on_change
        self._seq = 0
        self._registered = False  # Redis holds our registration, as far as we know
        self._reachable = False  # the last Redis operation succeeded
        self._detail = "not registered yet"
        self._reported: bool | None = None  # `registered` as last told to on_change
        self._need_snapshot = True
        self._next_heartbeat = 0.0
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.fatal: BaseException | None = None
        self.fatal_event = asyncio.Event()

    @property
    def registered(self) -> bool:
        """Registered and publishing now: False before the first registration and while Redis
        is unreachable (this is the engine's `pdmesh:index_up`)."""
        return self._registered and self._reachable

    @property
    def detail(self) -> str:
        """Why `registered` is False; empty while it is True."""
        return "" if self.registered else self._detail

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"presence-{self.info.instance_id}")

    async def try_register(self) -> bool:
        """One registration attempt before serving, so a scheme mismatch fails start-up.

        False (logged) when Redis is unreachable; the loop started by `start()` retries.
        Raises `SchemeMismatchError` when the cluster refuses this instance.
        """
        try:
            await self._register()
        except IndexUnavailable as exc:
            logger.warning("redis unavailable at start-up, serving unregistered: %s", exc)
            self._lost(exc)
            await self._report()
            return False
        self._next_heartbeat = asyncio.get_running_loop().time() + self._heartbeat_s
        await self._report()
        return True

    async def stop(self) -> None:
        """Stop the loop and deregister (best effort: Redis may be gone)."""
        self._stopping.set()
        if self._task is not None:
            await self._task
        if self._registered:
            try:
                await self._registry.deregister(self.info.instance_id)
            except IndexUnavailable as exc:
                logger.info("deregister skipped: %s", exc)
            self._registered = False

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                wait = await self._sync()
            except SchemeMismatchError as exc:
                logger.error("refused by the cluster: %s", exc)
                self.fatal = exc
                self.fatal_event.set()
                return
            except IndexUnavailable as exc:
                self._lost(exc)
                await self._report()
                # Nothing can be published until Redis is back, and the snapshot sent then
                # supersedes these events: drop them rather than let them pile up.
                await self._take_events()
                self._events_ready.clear()
                await self._sleep(self._backoff.next_delay())
                continue
            self._backoff.reset()
            await self._report()
            await self._wait(wait)

    async def _sync(self) -> float:
        """Register or heartbeat when due, then publish; returns seconds to the next heartbeat.

        Raises IndexUnavailable when Redis cannot be reached."""
        now = asyncio.get_running_loop().time()
        if not self._registered:
            await self._register()
            self._next_heartbeat = now + self._heartbeat_s
        elif now >= self._next_heartbeat:
            alive = await self._registry.heartbeat(self.info.instance_id, self._load())
            self._next_heartbeat = now + self._heartbeat_s
            self._reachable = True
            if not alive:  # expired, or Redis lost it (restarted empty): register anew
                logger.info("registration lost instance_id=%s; registering again",
                            self.info.instance_id)
                await self._register()
        await self._publish()
        if not self._registered:  # the index did not know us (see ApplyResult.needs_register)
            await self._register()
            await self._publish()
        return max(0.0, min(self._heartbeat_s,
                            self._next_heartbeat - asyncio.get_running_loop().time()))

    def _lost(self, exc: IndexUnavailable) -> None:
        if self._reachable:
            logger.warning("cluster index unreachable instance_id=%s, serving unindexed and "
                           "retrying with back-off: %s", self.info.instance_id, exc)
        self._reachable = False
        self._detail = f"redis unavailable: {exc}"
        self._need_snapshot = True  # whatever was in flight is lost; resend everything
        self._next_heartbeat = 0.0  # prove the registration survived as soon as Redis answers

    async def _report(self) -> None:
        """Tell `on_change` when `registered` flipped (a failing callback is only logged)."""
        now = self.registered
        if now == self._reported:
            return
        if now and self._reported is False:
            logger.info("cluster index reachable again instance_id=%s", self.info.instance_id)
        self._reported = now
        if self._on_change is not None:
            try:
                await self._on_change(now, self.detail)
            except Exception:
                logger.exception("presence change callback failed")

    async def _sleep(self, timeout_s: float) -> None:
        """Until stop or `timeout_s`; new events do not cut a back-off short."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout_s)

    async def _wait(self, timeout_s: float) -> None:
        """Until stop, new events (then a short batching pause) or `timeout_s`."""
        stop = asyncio.ensure_future(self._stopping.wait())
        ready = asyncio.ensure_future(self._events_ready.wait())
        try:
            await asyncio.wait({stop, ready}, timeout=timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            ready.cancel()
        if self._events_ready.is_set() and not self._stopping.is_set():
            self._events_ready.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._publish_s)

    async def _register(self) -> None:
        info = dataclasses.replace(self.info, load=dict(self._load()))
        replaced = await self._registry.register(info)
        self._registered = True
        self._reachable = True
        self._detail = ""
        self._need_snapshot = True
        logger.info("registered instance_id=%s role=%s address=%s replaced=%s",
                    info.instance_id, info.role, info.address, replaced)

    async def _publish(self) -> None:
        if self._need_snapshot:
            events = await self._snapshot()
        else:
            events = await self._take_events()
            if not events:
                return
        self._seq += 1
        batch = KVEventBatch(self.info.instance_id, self._seq, events)
        try:
            result = await self._index.apply(batch)
        except IndexUnavailable:
            self._need_snapshot = True  # the batch is lost; resend everything later
            raise
        self._need_snapshot = result.needs_snapshot
        if result.needs_register:
            self._registered = False


# -- configuration ---------------------------------------------------------------------------------
def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of a dataclass field annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        return _base_type(args[0])[0], optional
    if origin is typing.Literal:
        return type(typing.get_args(tp)[0]), False
    return tp, False


def _convert(name: str, raw: str, tp: type, optional: bool) -> Any:
    if optional and raw.strip().lower() in ("", "none"):
        return None
    if tp is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {raw!r}")
    if tp in (int, float):
        try:
            return tp(raw)
        except ValueError:
            raise ValueError(f"{name}: expected {tp.__name__}, got {raw!r}") from None
    if tp in (tuple, list) or typing.get_origin(tp) in (tuple, list):
        return tuple(s.strip() for s in raw.split(",") if s.strip())
    return raw


def parse_config(
    cls: type[C], argv: Sequence[str] | None, *, prog: str, description: str = "",
    env: Mapping[str, str] | None = None,
) -> C:
    """Build `cls` (a dataclass) from defaults, then PDMESH_<FIELD> env vars, then CLI flags.

    Field `kv_backend` becomes flag `--kv-backend` and env var `PDMESH_KV_BACKEND`; the field's
    `metadata["help"]` is its help text. Booleans take `--flag/--no-flag`. Validation is the
    dataclass's `__post_init__`; its ValueError becomes an argparse error (exit code 2).
    """
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=description)
    specs: dict[str, tuple[type, bool]] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init:
            continue
        tp, optional = _base_type(hints[f.name])
        specs[f.name] = (tp, optional)
        flag = "--" + f.name.replace("_", "-")
        env_name = "PDMESH_" + f.name.upper()
        help_text = f"{f.metadata.get('help', '')} (env {env_name})".strip()
        if tp is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, help=help_text)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    try:
        for name, (tp, optional) in specs.items():
            cli = getattr(args, name)
            env_value = env.get("PDMESH_" + name.upper())
            if isinstance(cli, bool):
                values[name] = cli
            elif cli is not None:
                values[name] = _convert("--" + name.replace("_", "-"), cli, tp, optional)
            elif env_value is not None:
                values[name] = _convert("PDMESH_" + name.upper(), env_value, tp, optional)
        return cls(**values)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def split_address(address: str) -> tuple[str, int]:
    """`host:port` -> (host, port); raises ValueError naming the address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)

