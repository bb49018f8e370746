"""The router process (`pdmesh router`): start-up, health mirroring, drain and teardown around
the Router service (`router/server.py`).

Start-up loads the tokenizer and the sampling defaults, connects Redis (when given), polls the
instances until a decode instance is routable (or `--startup-wait-s` passes), then serves;
`HealthReporter` mirrors the pool's state into the gRPC health service after every poll round.
SIGTERM drains: running streams finish (up to `--drain-timeout-s`), new Generate calls are
refused with UNAVAILABLE and a retry hint, then each teardown step runs under its own bound.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2

from pdmesh.engine.generation_config import (
    load_generation_defaults,
)
from pdmesh.engine.model_store import resolve_tokenizer, tokenizer_source
from pdmesh.gc_heap import freeze_startup_heap
from pdmesh.grpc_common import (
    DRAINING,
    REFUSED_KEY,
    GrpcServer,
    await_bounded,
    install_shutdown_signals,
)
from pdmesh.kvstore.instance_registry import InstanceRegistry
from pdmesh.kvstore.prefix_index import PrefixIndex
from pdmesh.kvstore.redis_conn import RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace
from pdmesh.logs import run_service
from pdmesh.metrics import (
    RouterCollector,
    RouterMetrics,
    RouterState,
    process_registry,
    router_metrics,
    start_metrics_server,
)
from pdmesh.router.admission import (
    RETRY_AFTER_KEY,
    retry_after_ms,
)
from pdmesh.router.config import RouterConfig, parse_router_config
from pdmesh.router.failures import UNAVAILABLE_RETRY_AFTER_S
from pdmesh.router.instances import InstancePool, PoolSettings
from pdmesh.router.orchestrator import Orchestrator
from pdmesh.router.peer_prefix import PeerReuse
from pdmesh.router.prompt_tokenizer import PromptTokenizer
from pdmesh.router.routing import make_policy
from pdmesh.router.server import (
    INDEX_HEALTH_NAME,
    SERVICE_NAME,
    RouterService,
)
from pdmesh.slo import parse_goodput
from pdmesh.v1 import router_pb2_grpc

logger = logging.getLogger(__name__)


class HealthReporter:
    """Mirrors the pool's state into the health service: whether a request can be routed
    (SERVICE_NAME) and whether the prefix index is reachable (INDEX_HEALTH_NAME). "" is left
    SERVING: it is the process's liveness, not its readiness."""

    def __init__(self, server: GrpcServer, pool: InstancePool) -> None:
        self._server = server
        self._pool = pool
        self._last: dict[str, bool] = {}

    async def update(self) -> None:
        servable = self._pool.servability()
        await self._set(SERVICE_NAME, servable.serving, "router", servable.detail)
        await self._set(INDEX_HEALTH_NAME, self._pool.index_available, "prefix index",
                        self._pool.index_detail or "routing on load only")

    async def run(self) -> None:
        """Update after every completed poll round, until cancelled."""
        while True:
            await self._pool.wait_polled()
            await self.update()

    async def _set(self, name: str, ok: bool, what: str, detail: str) -> None:
        previous = self._last.get(name)
        if previous == ok:
            return
        self._last[name] = ok
        await self._server.health.set(
            name,
            health_pb2.HealthCheckResponse.SERVING if ok
            else health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        if previous is None:
            logger.info("%s %s %s", what, "SERVING" if ok else "NOT_SERVING:", detail)
        elif not ok:
            logger.warning("%s NOT_SERVING: %s", what, detail)
        else:
            logger.info("%s SERVING again", what)


async def _first_contact(pool: InstancePool, timeout_s: float) -> None:
    """Poll until a decode instance is routable (or `timeout_s` passes), so that a router
    that says "ready" can serve at once; without one it still starts and keeps polling."""
    deadline = time.monotonic() + timeout_s
    while True:
        await pool.poll_once()
        if pool.routable("decode") or time.monotonic() >= deadline:
            break
        await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    if not pool.routable("decode"):
        logger.warning("no routable decode instance after %gs; serving anyway", timeout_s)


async def serve(config: RouterConfig, stop: asyncio.Event | None = None) -> None:
    """Run the router until `stop` is set (SIGINT/SIGTERM when not given)."""
    stop = stop or asyncio.Event()
    install_shutdown_signals(stop, config.drain_timeout_s)
    metrics: RouterMetrics = router_metrics()
    # The tokenizer vLLM would read (`tokenizer_source`: --tokenizer or the model, at
    # --tokenizer-revision or --revision): configs and tokenizer files only, no weights.
    name, revision = tokenizer_source(config)
    source = await asyncio.to_thread(
        resolve_tokenizer, name, download_dir=config.download_dir, revision=revision)
    tokenizer = await asyncio.to_thread(
        PromptTokenizer, str(source), config.tokenizer_pool_size, config.chat_template,
        metrics.tokenize_wait, template_defaults=config.template_defaults,
    )
    defaults = load_generation_defaults(config.generation_config, source,
                                        config.override_generation_config)
    conn = RedisConnection.from_url(
        config.redis_url, password_file=config.redis_password_file, ca_file=config.redis_ca,
    ) if config.redis_url else None
    keys = KeySpace(model=config.model_name)
    static = [("prefill", a) for a in config.prefill] + [("decode", a) for a in config.decode]
    pool = InstancePool(
        PoolSettings(
            model=config.model_name,
            poll_interval_s=config.poll_interval_s,
            failure_threshold=config.failure_threshold,
            rpc_timeout_s=config.rpc_timeout_s,
            tls=config.tls,
            max_message_bytes=config.max_message_bytes,
            token=config.cluster_token,
            stall=config.stall.bound(),
        ),
        static=static,
        registry=InstanceRegistry(conn, keys) if conn else None,
    )
    orchestrator = Orchestrator(
        pool,
        {
            role: make_policy(config.routing_policy, prefix_weight=config.prefix_weight)
            for role in ("prefill", "decode")
        },
        PrefixIndex(conn, keys) if conn else None,
        local_prefill_threshold=config.local_prefill_threshold,
        rpc_timeout_s=config.rpc_timeout_s,
        peer_reuse=PeerReuse(config.kv_peer_reuse, config.kv_peer_reuse_min_tokens),
        migration_limit=config.migration_limit,
        stream_kv=config.kv_stream_chunks,
        slos=parse_goodput(config.goodput),
        metrics=metrics,
        token=config.cluster_token,
    )
    service = RouterService(config, tokenizer, pool, orchestrator, defaults)
    collector = RouterCollector(
        lambda: RouterState(
            running=service.admission.running,
            queued=service.admission.queued,
            inflight_tokens=service.admission.inflight_tokens,
            instances=[(i.role, i.healthy) for i in pool.instances()],
            index_up=pool.index_available if conn is not None else None,
        )
    )
    server = GrpcServer(
        [SERVICE_NAME],
        host=config.host,
        port=config.port,
        tls=config.tls,
        max_message_bytes=config.max_message_bytes,
        drain_methods=[f"/{SERVICE_NAME}/Generate"],
        refusal=_refuse_draining,
    )
    router_pb2_grpc.add_RouterServicer_to_server(service, server.server)
    await _first_contact(pool, timeout_s=config.startup_wait_s)
    endpoint = None
    if config.metrics_port >= 0:  # before serving: a taken port must fail the start-up
        endpoint = start_metrics_server(config.metrics_host or config.host, config.metrics_port,
                                        certfile=config.tls_cert, keyfile=config.tls_key)
    process_registry().register(collector)
    pool.start()
    address = await server.start()
    health = HealthReporter(server, pool)
    await health.update()  # start() said SERVING for every name; correct that at once
    health_task = asyncio.create_task(health.run())
    logger.info("router serving address=%s policy=%s", address, config.routing_policy)
    freeze_startup_heap()  # the tokenizer, the pool, gRPC: no more GC scans of them
    print(f"ready {address} metrics={endpoint.url if endpoint else ''}", flush=True)
    try:
        await stop.wait()
    finally:
        health_task.cancel()  # it must not report SERVING again while draining
        if stop.is_set():
            # Drain: NOT_SERVING, refuse new Generate calls, let the running streams finish.
            logger.info("router draining calls=%d timeout_s=%g", server.gate.inflight,
                        config.drain_timeout_s)
            left = await server.drain(config.drain_timeout_s)
            (logger.warning if left else logger.info)("router drained; cutting calls=%d", left)
        logger.info("router shutting down")
        process_registry().unregister(collector)
        if endpoint is not None:
            endpoint.close()
        # Each step bounded: a library stuck in its close must not keep the process (and its
        # port) past the drain deadline; the log names the step that hung. Together they stay
        # inside TEARDOWN_BOUND_S, before the exit watchdog.
        await await_bounded("the gRPC server's stop", server.stop(grace_s=1.0), 3.0)
        await await_bounded("cleanup calls", orchestrator.drain(timeout_s=2.0), 2.5)
        await await_bounded("the instance pool's stop", pool.stop(), 1.5)
        tokenizer.close()
        service.grammars.close()
        if conn is not None:
            await await_bounded("the Redis connection's close", conn.aclose(), 1.0)


async def _refuse_draining(context: grpc.aio.ServicerContext) -> None:
    """A Generate arriving while this router drains: UNAVAILABLE with a retry hint, marked
    refused-before-work, so a client (or the gateway) may send it to another router."""
    context.set_trailing_metadata((
        (REFUSED_KEY, DRAINING),
        (RETRY_AFTER_KEY, retry_after_ms(UNAVAILABLE_RETRY_AFTER_S)),
    ))
    await context.abort(grpc.StatusCode.UNAVAILABLE,
                        "router is draining before shutdown; retry in a moment")


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_router_config(argv)
    return run_service("router", config.log_level, lambda: serve(config))


if __name__ == "__main__":
    sys.exit(main())
