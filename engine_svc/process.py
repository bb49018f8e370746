"""The life cycle of one engine process, whatever its role: start the engine, serve, register,
drain on SIGINT/SIGTERM.

Drain: the servers turn NOT_SERVING, new Prefill/Decode calls are refused with
`refuse(..., "draining")` (the router sends them elsewhere), the instance leaves the Redis
registry, and the running calls — and KV leases not pulled yet — get up to `--drain-timeout-s`
to end. Then the server stops: streams still open are cut (the router migrates them), leases
are released, and the process exits 0.

While serving, a watchdog (`engine_svc/watchdog.py`) turns the servers NOT_SERVING while the
engine core hangs with work in flight, and SERVING again once it answers; it stops before the
drain, which owns health from then on.

The role packages (`prefill_svc/`, `decode_svc/`) each contribute a `RolePart` (their servicer
and their end of the KV transfer) through a `RolePartFactory`; this module never imports them,
so neither role package depends on the other. `pdmesh.engines` composes the processes.

With its engine core in a process of its own (the default) and the core moving KV itself, this
process imports no torch (tests/unit/test_engine_service_without_torch.py): the in-process
core and the staged KV transports load it where they are used.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2

from pdmesh.devices import engines_use_cuda
from pdmesh.engine.frontend.async_engine import AsyncEngine
from pdmesh.engine_svc.config import EngineServiceConfig
from pdmesh.engine_svc.kv_peer import SENDER_BACKENDS, KVPeerPart, lends_kv
from pdmesh.engine_svc.presence import PRESENCE_HEALTH_NAME, ClusterPresence, PresenceChangeFn
from pdmesh.engine_svc.service import EngineService, Role
from pdmesh.gc_heap import freeze_startup_heap
from pdmesh.grpc_common import GrpcServer, install_shutdown_signals
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.grant_mac import new_key
from pdmesh.kvstore.connector.source import WORKER_BACKENDS
from pdmesh.kvstore.instance_registry import (
    InstanceInfo,
    SchemeMismatchError,
    sign_registration,
)
from pdmesh.kvstore.redis_conn import RedisConnection
from pdmesh.kvstore.transfer.backends import limit_torch_threads, unavailable_reason
from pdmesh.kvstore.transfer.backends.availability import ucx_tcp_only
from pdmesh.metrics import (
    EngineCollector,
    EngineMetrics,
    MetricsEndpoint,
    engine_metrics,
    process_registry,
    start_metrics_server,
)

logger = logging.getLogger(__name__)

RECEIVER_BACKENDS = ("shm", "ucxx", "tcp", "torch_dist")
EXIT_SCHEME_MISMATCH = 3
EXIT_ENGINE_DEAD = 4


class RolePart(Protocol):
    """What one role package adds to an engine process: a servicer and its KV transfer end."""

    service_name: str
    """The full gRPC service name (`pdmesh.v1.Prefill`), reported in health and reflection."""

    work_methods: tuple[str, ...]
    """Full paths of the calls that start work (`/pdmesh.v1.Prefill/Prefill`): refused while
    draining, waited for before the process exits."""

    @property
    def kv_address(self) -> str:
        """The KV sender's control address others pull from; empty when this part sends none."""
        ...

    async def start(self, server: grpc.aio.Server) -> None:
        """Start the KV transfer end and add the servicer to `server` (not started yet)."""
        ...

    def pending(self) -> int:
        """Work still owed after its calls ended (published KV not pulled yet); drain waits."""
        ...

    async def stop(self) -> None:
        """After the gRPC server stopped: release what the transfer end still holds."""
        ...


RolePartFactory = Callable[[EngineService, EngineMetrics], RolePart]
"""Builds a role's part over the process's shared `EngineService`."""


def _index_health_reporter(server: GrpcServer) -> PresenceChangeFn:
    """Mirror the instance's presence in the Redis index into PRESENCE_HEALTH_NAME. Only that
    name: losing the index degrades routing, not this engine's ability to serve."""

    async def report(registered: bool, detail: str) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if registered
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.health.set(PRESENCE_HEALTH_NAME, status)  # presence logs the why

    return report


async def _drain(
    server: GrpcServer, parts: Sequence[RolePart], timeout_s: float, instance_id: str
) -> None:
    """Until the running calls ended and the parts owe nothing more, or `timeout_s` passed."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + timeout_s
    logger.info("draining instance_id=%s calls=%d pending=%d timeout_s=%g", instance_id,
                server.gate.inflight, sum(p.pending() for p in parts), timeout_s)
    calls = await server.gate.wait_idle(timeout_s)
    while not calls and any(p.pending() for p in parts) and loop.time() < deadline:
        await asyncio.sleep(0.05)  # leases end on another thread; bounded by the deadline
    pending = sum(p.pending() for p in parts)
    log = logger.warning if calls or pending else logger.info
    log("drained instance_id=%s in %.1fs; cutting calls=%d pending=%d", instance_id,
        loop.time() - started, calls, pending)


def _kv_backends(config: EngineServiceConfig, role: Role) -> tuple[str, ...]:
    """The usable KV data planes this instance offers (prefill) or accepts (decode); asked
    without importing the planes' modules (torch). Under `auto`, ucxx only where it has more
    than TCP to use (`ucx_tcp_only`): elsewhere its listener's thread only costs CPU."""
    preferred = SENDER_BACKENDS if role == "prefill" else RECEIVER_BACKENDS
    if ("ucxx" in preferred and unavailable_reason("ucxx") is None  # before the CUDA probe
            and ucx_tcp_only(engines_use_cuda(config.engine.device))):
        preferred = tuple(b for b in preferred if b != "ucxx")
    return tuple(b for b in config.kv_backends(preferred) if unavailable_reason(b) is None)


def connector_config(config: EngineServiceConfig,
                     backends: tuple[str, ...]) -> KVConnectorConfig | None:
    """How the engine core moves KV itself: its share of `backends` (shm: a cache file peer
    cores copy from; tcp: a block server; ucxx: a ucxx listener), on the service's host and
    TLS files, with a fresh key the KV sender signs granted pulls with. None when only staged
    transports remain."""
    own = [b for b in backends if b in WORKER_BACKENDS]
    if not own:
        return None
    return KVConnectorConfig(
        shared_cache="shm" in own, tcp="tcp" in own or "torch_dist" in own,
        ucx="ucxx" in own, tcp_host=config.host,
        tcp_advertise_host=config.public_host, tls_cert=config.tls_cert or "",
        tls_key=config.tls_key or "", tls_ca=config.tls_ca or "", grant_secret=new_key())


async def start_engine(config: EngineServiceConfig, role: Role,
                       connector: KVConnectorConfig | None = None) -> AsyncEngine:
    """The engine core in its own process (the default), or on a thread of this one."""
    engine_config = config.engine
    if engine_config.engine_core_process:
        # This process only moves bytes now (gRPC, tokens, KV frames); torch, which it loads
        # only for a staged KV plane, must not start a spinning thread per core beside the
        # core's (engine/worker/cpu_threads.py).
        limit_torch_threads(1)
        return await AsyncEngine.spawn(engine_config, name=f"{role}-engine",
                                       log_level=config.log_level, connector=connector)
    from pdmesh.engine.frontend.llm_engine import LLMEngine  # the in-process core: torch and all

    llm_engine = await asyncio.to_thread(LLMEngine, engine_config, connector)
    return AsyncEngine(llm_engine, name=f"{role}-engine")


async def serve(
    config: EngineServiceConfig, role: Role, parts: Sequence[RolePartFactory]
) -> int:
    """Run one engine process serving `parts` until SIGINT/SIGTERM; returns the exit code."""
    stop = asyncio.Event()
    install_shutdown_signals(stop, config.drain_timeout_s)
    started = time.monotonic()
    backends = _kv_backends(config, role)
    if not backends:
        logger.error("no usable KV backend among %s",
                     config.kv_backends(SENDER_BACKENDS if role == "prefill"
                                        else RECEIVER_BACKENDS))
        return 2
    connector = connector_config(config, backends)
    engine = await start_engine(config, role, connector)
    if (role != "colocated" and config.engine.tensor_parallel_size > 1
            and not (engine.info.kv_cache_file or engine.info.kv_cache_ipc
                     or engine.info.kv_block_server)):
        # A tensor-parallel core moves KV only between caches on one host (rank_caches.py)
        logger.error("--tensor-parallel-size > 1 for the %s role needs every rank's KV cache "
                     "shared with the core (shm files on CPU, CUDA IPC on GPUs); this core "
                     "lends no KV (see its log): run it colocated", role)
        await engine.shutdown()
        return 2
    service = EngineService(config, role, engine, kv_backends=backends, connector=connector)
    metrics = engine_metrics(role, model_name=config.model_name)
    role_parts: list[RolePart] = []
    if lends_kv(role, service):
        service.kv_peer = KVPeerPart(service, metrics)
        role_parts.append(service.kv_peer)
    role_parts += [make(service, metrics) for make in parts]
    grpc_server = GrpcServer(
        [p.service_name for p in role_parts], host=config.host, port=config.port,
        tls=config.tls, max_message_bytes=config.max_message_bytes, token=config.cluster_token,
        drain_methods=[m for p in role_parts for m in p.work_methods],
    )
    for part in role_parts:
        await part.start(grpc_server.server)
    kv_address = next((p.kv_address for p in role_parts if p.kv_address), "")
    address = await grpc_server.start()
    if config.advertise_host:
        address = f"{config.public_host}:{grpc_server.port}"

    presence: ClusterPresence | None = None
    conn: RedisConnection | None = None
    exit_code = 0
    if config.redis_url:
        conn = RedisConnection.from_url(config.redis_url, password_file=config.redis_password_file,
                                        ca_file=config.redis_ca)
        info = InstanceInfo(
            instance_id=service.instance_id,
            role=role,
            address=address,
            model=config.model_name,
            scheme_fingerprint=engine.info.hash_fingerprint,
            scheme_description=engine.info.hash_description,
            block_size=engine.info.block_size,
            started_at=time.time(),
            kv_address=kv_address or None,
        )
        info = sign_registration(info, config.cluster_token)  # routers verify it
        presence = ClusterPresence(
            conn, info, load=service.load_figures, take_events=engine.take_kv_events,
            snapshot=engine.kv_snapshot, events_ready=engine.kv_events_ready,
            ttl_s=config.heartbeat_ttl_s, on_change=_index_health_reporter(grpc_server),
        )
        try:
            await presence.try_register()
        except SchemeMismatchError as exc:
            print(f"error: refused by the cluster: {exc}", file=sys.stderr, flush=True)
            presence = None
            stop.set()
            exit_code = EXIT_SCHEME_MISMATCH
        if presence is not None:
            presence.start()

    collector = EngineCollector(role, lambda: service.metrics_state(
        None if not config.redis_url else presence is not None and presence.registered),
        model_name=config.model_name)
    process_registry().register(collector)
    endpoint: MetricsEndpoint | None = None
    if exit_code == 0 and config.metrics_port >= 0:
        try:
            endpoint = start_metrics_server(config.metrics_bind_host, config.metrics_port,
                                            certfile=config.tls_cert, keyfile=config.tls_key)
        except OSError as exc:
            print(f"pdmesh {role}: error: {exc}", file=sys.stderr, flush=True)
            stop.set()
            exit_code = 1

    if exit_code == 0:
        freeze_startup_heap()  # the tokenizer, gRPC and the rest of start-up: no GC scans
        print(f"ready {address} role={role} instance_id={service.instance_id} "
              f"kv_address={kv_address} torch_threads={engine.info.torch_threads} "
              f"core_pid={engine.core_pid or ''} "
              f"metrics={endpoint.url if endpoint else ''} "
              f"startup_s={time.monotonic() - started:.1f}", flush=True)
        watchdog = asyncio.ensure_future(service.watchdog.run(grpc_server.set_serving))
        waiters = [asyncio.ensure_future(stop.wait()),
                   asyncio.ensure_future(engine.dead_event.wait())]
        if presence is not None:
            waiters.append(asyncio.ensure_future(presence.fatal_event.wait()))
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in [*waiters, watchdog]:
            waiter.cancel()
        if presence is not None and presence.fatal is not None:
            exit_code = EXIT_SCHEME_MISMATCH
        if engine.dead_reason is not None:
            # Without its core this instance can serve nothing: NOT_SERVING at once (the
            # drain below), out of the registry, exit non-zero so it gets restarted.
            logger.error("instance_id=%s: %s; stopping", service.instance_id,
                         engine.dead_reason)
            exit_code = EXIT_ENGINE_DEAD

    # Drain: refuse new work (routers re-route it), leave the registry, let running work end.
    await grpc_server.begin_drain()
    if presence is not None:
        await presence.stop()
    if conn is not None:
        await conn.aclose()
    if exit_code == 0:
        await _drain(grpc_server, role_parts, config.drain_timeout_s, service.instance_id)
    await grpc_server.stop(grace_s=1.0)  # cuts what is left: routers migrate those streams
    for part in role_parts:
        await part.stop()  # a sender releases every lease; on_release frees pinned blocks
    await engine.shutdown()
    if endpoint is not None:
        endpoint.close()
    process_registry().unregister(collector)
    return exit_code
