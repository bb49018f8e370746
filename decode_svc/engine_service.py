"""What every engine process shares, whatever its role: identity, counters, info, load, and
the process life cycle (start the engine, serve, register, drain on SIGINT/SIGTERM).

Roles: `prefill` serves the Prefill service, `decode` the Decode service, `colocated` both
over one engine. The role only decides which servicers and which KV transfer ends (sender,
receiver) are created; everything else is here once.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from grpc_health.v1 import health_pb2

from pdmesh.decode_svc.config import EngineServiceConfig
from pdmesh.engine.async_engine import AsyncEngine
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.grpc_common import (
    PRESENCE_HEALTH_NAME,
    ClusterPresence,
    GrpcServer,
    PresenceChangeFn,
    channel_credentials,
    install_shutdown_signals,
    server_credentials,
)
from pdmesh.kvstore.instance_registry import InstanceInfo, SchemeMismatchError, new_instance_id
from pdmesh.kvstore.redis_conn import RedisConnection
from pdmesh.kvstore.transfer import (
    KVReceiver,
    KVReceiverConfig,
    KVSender,
    KVSenderConfig,
    available_backends,
)
from pdmesh.metrics import (
    EngineCollector,
    EngineState,
    MetricsEndpoint,
    engine_metrics,
    process_registry,
    start_metrics_server,
)
from pdmesh.tracing import configure_tracing, shutdown_tracing
from pdmesh.v1 import engine_pb2

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "colocated"]
ROLE_PROTO = {
    "prefill": engine_pb2.ROLE_PREFILL,
    "decode": engine_pb2.ROLE_DECODE,
    "colocated": engine_pb2.ROLE_COLOCATED,
}
SENDER_BACKENDS = ("shm", "tcp")  # what a prefill instance offers by default, preferred first
RECEIVER_BACKENDS = ("shm", "ucxx", "tcp", "torch_dist")
EXIT_SCHEME_MISMATCH = 3


@dataclass
class KVCounters:
    """KV bytes moved, for GetLoad; updated from transfer callbacks on any thread."""

    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_sent: int = 0
    transfers_received: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_sent(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_sent += nbytes
            self.transfers_sent += 1

    def add_received(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_received += nbytes
            self.transfers_received += 1


class EngineService:
    """Identity, static info and live load of one engine instance (shared by servicers)."""

    def __init__(
        self,
        config: EngineServiceConfig,
        role: Role,
        engine: AsyncEngine,
        *,
        instance_id: str | None = None,
        kv_backends: tuple[str, ...] = (),
    ) -> None:
        self.config = config
        self.role = role
        self.engine = engine
        self.instance_id = instance_id or new_instance_id(role)
        self.kv_backends = kv_backends
        self.counters = KVCounters()

    def info(self) -> engine_pb2.EngineInfo:
        e = self.engine.engine
        return engine_pb2.EngineInfo(
            model=self.config.model_name,
            instance_id=self.instance_id,
            role=ROLE_PROTO[self.role],
            block_size=self.engine.block_size,
            hash_scheme_fingerprint=e.scheme.fingerprint(),
            max_model_len=self.engine.max_model_len,
            kv_capacity_tokens=self.engine.num_total_blocks * self.engine.block_size,
            kv_backends=list(self.kv_backends),
        )

    def load(self) -> engine_pb2.EngineLoad:
        snap = self.engine.load()
        c = self.counters
        return engine_pb2.EngineLoad(
            instance_id=self.instance_id,
            role=ROLE_PROTO[self.role],
            num_running=snap.num_running,
            num_waiting=snap.num_waiting,
            kv_usage=snap.kv_usage,
            num_free_blocks=snap.num_free_blocks,
            num_total_blocks=snap.num_total_blocks,
            num_pinned_blocks=snap.num_pinned_blocks,
            prefix_hit_tokens=snap.prefix_hit_tokens,
            prefix_query_tokens=snap.prefix_query_tokens,
            kv_bytes_sent=c.bytes_sent,
            kv_bytes_received=c.bytes_received,
            kv_transfers_sent=c.transfers_sent,
            kv_transfers_received=c.transfers_received,
        )

    def metrics_state(self, index_up: bool | None) -> EngineState:
        """The scrape-time figures of this instance (see pdmesh.metrics.EngineCollector)."""
        snap = self.engine.load()
        return EngineState(
            num_running=snap.num_running,
            num_waiting=snap.num_waiting,
            kv_usage=snap.kv_usage,
            num_free_blocks=snap.num_free_blocks,
            num_total_blocks=snap.num_total_blocks,
            num_pinned_blocks=snap.num_pinned_blocks,
            prefix_query_tokens=snap.prefix_query_tokens,
            prefix_hit_tokens=snap.prefix_hit_tokens,
            index_up=index_up,
        )

    def load_figures(self) -> dict[str, float]:
        """The heartbeat's load (flat numbers; see InstanceInfo.load)."""
        snap = self.engine.load()
        return {
            "running": snap.num_running,
            "waiting": snap.num_waiting,
            "kv_usage": snap.kv_usage,
            "free_blocks": snap.num_free_blocks,
            "total_blocks": snap.num_total_blocks,
            "pinned_blocks": snap.num_pinned_blocks,
        }




def _index_health_reporter(server: GrpcServer) -> PresenceChangeFn:
    """Mirror the instance's presence in the Redis index into PRESENCE_HEALTH_NAME. Only that
    name: losing the index degrades routing, not this engine's ability to serve."""

    async def report(registered: bool, detail: str) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if registered
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.health.set(PRESENCE_HEALTH_NAME, status)  # presence logs the why

    return report


def _service_names(role: Role) -> list[str]:
    from pdmesh.v1 import engine_pb2 as pb

    names = []
    if role in ("prefill", "colocated"):
        names.append(pb.DESCRIPTOR.services_by_name["Prefill"].full_name)
    if role in ("decode", "colocated"):
        names.append(pb.DESCRIPTOR.services_by_name["Decode"].full_name)
    return names


async def serve(config: EngineServiceConfig, role: Role) -> int:
    """Run one engine process until SIGINT/SIGTERM; returns the exit code."""
    try:
        configure_tracing(f"pdmesh-{role}")
    except ValueError as exc:
        print(f"pdmesh {role}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        return await _serve(config, role)
    finally:
        shutdown_tracing()


async def _serve(config: EngineServiceConfig, role: Role) -> int:
    from pdmesh.decode_svc.servicer import DecodeServicer
    from pdmesh.prefill_svc.servicer import PrefillServicer
    from pdmesh.v1 import engine_pb2_grpc

    stop = asyncio.Event()
    install_shutdown_signals(stop)
    started = time.monotonic()
    llm_engine = await asyncio.to_thread(LLMEngine, config.engine_config())
    engine = AsyncEngine(llm_engine, name=f"{role}-engine")
    usable = set(available_backends())
    sends = role in ("prefill", "colocated")
    receives = role in ("decode", "colocated")
    preferred = SENDER_BACKENDS if sends and not receives else RECEIVER_BACKENDS
    backends = tuple(b for b in config.kv_backends(preferred) if b in usable)
    if not backends:
        logger.error("no usable KV backend among %s", config.kv_backends(preferred))
        await engine.shutdown()
        return 2
    service = EngineService(config, role, engine, kv_backends=backends)
    metrics = engine_metrics(role)
    grpc_server = GrpcServer(
        _service_names(role), host=config.host, port=config.port, tls=config.tls,
        max_message_bytes=config.max_message_bytes,
    )
    sender: KVSender | None = None
    receiver: KVReceiver | None = None
    if sends:
        prefill = PrefillServicer(service, metrics=metrics)
        sender = KVSender(
            KVSenderConfig(
                host=config.host,
                port=config.kv_port,
                advertise_host=config.public_host,
                backends=tuple(b for b in backends if b in SENDER_BACKENDS) or backends,
                lease_s=getattr(config, "lease_s", 30.0),
                max_lease_s=max(getattr(config, "max_lease_s", 300.0),
                                getattr(config, "lease_s", 30.0)),
            ),
            on_release=prefill.on_release,
            server_credentials=server_credentials(config.tls),
        )
        await sender.start()
        prefill.sender = sender
        engine_pb2_grpc.add_PrefillServicer_to_server(prefill, grpc_server.server)
    if receives:
        receiver = KVReceiver(
            KVReceiverConfig(backends=backends),
            channel_credentials=channel_credentials(config.tls),
        )
        decode = DecodeServicer(
            service, receiver, kv_fetch_timeout_s=getattr(config, "kv_fetch_timeout_s", 30.0),
            metrics=metrics,
        )
        engine_pb2_grpc.add_DecodeServicer_to_server(decode, grpc_server.server)
    address = await grpc_server.start()
    if config.advertise_host:
        address = f"{config.public_host}:{grpc_server.port}"

    presence: ClusterPresence | None = None
    conn: RedisConnection | None = None
    exit_code = 0
    if config.redis_url:
        conn = RedisConnection.from_url(config.redis_url)
        info = InstanceInfo(
            instance_id=service.instance_id,
            role=role,
            address=address,
            model=config.model_name,
            scheme_fingerprint=llm_engine.scheme.fingerprint(),
            scheme_description=llm_engine.scheme.describe(),
            block_size=llm_engine.scheme.block_size,
            started_at=time.time(),
            kv_address=sender.address if sender is not None else None,
        )
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
        None if not config.redis_url else presence is not None and presence.registered))
    process_registry().register(collector)
    endpoint: MetricsEndpoint | None = None
    if exit_code == 0 and config.metrics_port >= 0:
        try:
            endpoint = start_metrics_server(config.metrics_bind_host, config.metrics_port)
        except OSError as exc:
            print(f"pdmesh {role}: error: {exc}", file=sys.stderr, flush=True)
            stop.set()
            exit_code = 1

    if exit_code == 0:
        print(f"ready {address} role={role} instance_id={service.instance_id} "
              f"kv_address={sender.address if sender else ''} "
              f"metrics={endpoint.url if endpoint else ''} "
              f"startup_s={time.monotonic() - started:.1f}", flush=True)
        waiters = [asyncio.ensure_future(stop.wait())]
        if presence is not None:
            waiters.append(asyncio.ensure_future(presence.fatal_event.wait()))
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in waiters:
            waiter.cancel()
        if presence is not None and presence.fatal is not None:
            exit_code = EXIT_SCHEME_MISMATCH

    logger.info("shutting down instance_id=%s", service.instance_id)
    await grpc_server.set_serving(False)
    if presence is not None:
        await presence.stop()
    if conn is not None:
        await conn.aclose()
    await grpc_server.stop(grace_s=1.0)  # cancels in-flight calls: their requests abort
    if sender is not None:
        await sender.stop()  # releases every lease; on_release frees pinned blocks
    if receiver is not None:
        await receiver.close()
    await engine.shutdown()
    if endpoint is not None:
        endpoint.close()
    process_registry().unregister(collector)
    return exit_code
