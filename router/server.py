"""The Router gRPC service (`pdmesh router`): the cluster's only public front door.

Generate = admit (validate, tokenize, budget) → route and run (orchestrator) → stream back.
Tokenize, ListModels and GetStatus answer from the router's own state. The standard health
service reports, updated after every instance poll:

* "" SERVING while the router process runs (liveness: restarting it would not bring back
  instances it cannot reach);
* "pdmesh.v1.Router" SERVING only while a request can be routed — a live decode-capable
  instance (without a live prefill-capable one, decode prefills every prompt itself)
  (`InstancePool.servability`, also `serving`/`serving_detail` in GetStatus). Readiness: the
  gateway's /health answers 503 while it is NOT_SERVING;
* "pdmesh.router.PrefixIndex" SERVING only while the Redis prefix index is reachable: without
  it the router keeps serving with load-only routing, and says so there, in GetStatus and in
  the `pdmesh:index_up` metric.

Each Generate call is one `pdmesh.router.generate` span (parent: the caller's `traceparent`
metadata, e.g. the gateway's) with `pdmesh.router.admission` and `pdmesh.router.route`
children; the prefill and decode calls carry its context on.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2
from opentelemetry import trace

from pdmesh.engine.generation_config import (
    GenerationDefaults,
    apply_to_proto,
    load_generation_defaults,
)
from pdmesh.engine.model_store import resolve_model
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
    Admission,
    DeadlineExpired,
    ExceedsKVCapacity,
    InvalidRequest,
    OverCapacity,
    budget_tokens,
    check_kv_capacity,
    retry_after_ms,
    sampling_from_proto,
    validate_prompt,
)
from pdmesh.router.config import RouterConfig, parse_router_config
from pdmesh.router.instances import InstancePool, PoolSettings
from pdmesh.router.orchestrator import (
    UNAVAILABLE_RETRY_AFTER_S,
    Orchestrator,
    PreparedRequest,
    RouteError,
)
from pdmesh.router.prompt_tokenizer import PromptTokenizer
from pdmesh.router.routing import make_policy
from pdmesh.tracing import (
    SpanKind,
    extract_metadata,
    gen_ai_request_attributes,
    get_tracer,
    mark_error,
)
from pdmesh.v1 import engine_pb2, router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdmesh.v1.Router"
INDEX_HEALTH_NAME = "pdmesh.router.PrefixIndex"
MAX_REQUEST_ID_BYTES = 128
UNSTREAMED_STREAM_INTERVAL = 64
"""The engines' stream interval for a request the client takes whole (stream=false): there
its deltas only keep the router's resume state (what a migration continues from), so one per
64 tokens saves the engine and the router nearly every per-token message while a migration
recomputes at most 64 tokens (vLLM hands such requests only their final output)."""
_ROLES = {
    "prefill": engine_pb2.ROLE_PREFILL,
    "decode": engine_pb2.ROLE_DECODE,
    "colocated": engine_pb2.ROLE_COLOCATED,
}


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(
        self,
        config: RouterConfig,
        tokenizer: PromptTokenizer,
        pool: InstancePool,
        orchestrator: Orchestrator,
        defaults: GenerationDefaults | None = None,
    ) -> None:
        self.config = config
        # Sampling defaults for what a request leaves unset (engine/generation_config.py).
        self.defaults = defaults or GenerationDefaults()
        self.tokenizer = tokenizer
        self.pool = pool
        self.orchestrator = orchestrator
        self.metrics = orchestrator.metrics
        self.admission = Admission(config.admission_limits())
        self._inflight: set[str] = set()

    # -- Generate ----------------------------------------------------------------------------
    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        received = time.monotonic()
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        with get_tracer().start_as_current_span(
            "pdmesh.router.generate",
            context=extract_metadata(context),
            kind=SpanKind.SERVER,
            attributes={"pdmesh.request_id": request_id},
        ) as span:
            status = _CallStatus(lambda code: self.metrics.requests.labels(code).inc())
            try:
                await self._generate_call(request, request_id, received, context, status)
            except asyncio.CancelledError:
                status.code = grpc.StatusCode.CANCELLED
                span.set_attribute("pdmesh.outcome", "cancelled")
                raise
            except BaseException:
                if status.code == grpc.StatusCode.OK:  # not one of our own aborts
                    status.code = grpc.StatusCode.UNKNOWN
                raise
            finally:
                status.settle(status.code)
                code = status.code
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                logger.info(
                    "request_id=%s code=%s e2e_ms=%.1f",
                    request_id,
                    code.name,
                    (time.monotonic() - received) * 1e3,
                )

    async def _generate_call(
        self,
        request: router_pb2.GenerateRequest,
        request_id: str,
        received: float,
        context: grpc.aio.ServicerContext,
        status: _CallStatus,
    ) -> None:
        """Serve one Generate, or abort the call (raising) with the status noted in `status`."""
        if request_id in self._inflight:
            self.metrics.admission_rejections.labels("duplicate_request_id").inc()
            await _abort(
                context,
                status,
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {request_id!r} is already in flight",
            )
        await context.send_initial_metadata((("x-request-id", request_id),))
        self._inflight.add(request_id)
        rejected = self.metrics.admission_rejections
        try:
            await self._generate(request, request_id, received, context)
        except InvalidRequest as exc:
            rejected.labels("invalid_argument").inc()
            await _abort(context, status, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OverCapacity as exc:
            rejected.labels(exc.reason).inc()
            await _abort(
                context,
                status,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{exc}; retry in {exc.retry_after_s:.1f}s",
                trailing_metadata=((RETRY_AFTER_KEY, retry_after_ms(exc.retry_after_s)),),
            )
        except ExceedsKVCapacity as exc:
            rejected.labels("kv_capacity").inc()
            await _abort(context, status, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except DeadlineExpired as exc:
            rejected.labels("deadline").inc()
            await _abort(context, status, grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except RouteError as exc:
            retry = exc.retry_after_s
            await _abort(
                context, status, exc.code, str(exc),
                trailing_metadata=(() if retry is None
                                   else ((RETRY_AFTER_KEY, retry_after_ms(retry)),)),
            )
        finally:
            self._inflight.discard(request_id)

    async def _generate(
        self,
        request: router_pb2.GenerateRequest,
        request_id: str,
        received: float,
        context: grpc.aio.ServicerContext,
    ) -> None:
        if len(request_id.encode()) > MAX_REQUEST_ID_BYTES or not request_id.isprintable():
            raise InvalidRequest(
                "request_id", f"must be printable and at most {MAX_REQUEST_ID_BYTES} bytes"
            )
        self._check_model(request.model)
        sampling = apply_to_proto(request.sampling, self.defaults)  # request > server default
        params = sampling_from_proto(sampling)
        max_model_len = self.pool.max_model_len()
        ids = await self.tokenizer.encode(request, max_model_len)  # refuses provably too long
        tokenize_ms = (time.monotonic() - received) * 1000
        if max_model_len is None:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "no live instance serves the model")
        max_tokens = validate_prompt(
            ids, params, vocab_size=self.tokenizer.vocab_size, max_model_len=max_model_len
        )
        sampling.max_tokens = max_tokens  # engines get the budget admission counted, not "unset"
        if not request.stream:
            sampling.stream_interval = max(sampling.stream_interval, UNSTREAMED_STREAM_INTERVAL)
        kv_capacity = self.pool.kv_capacity_tokens()
        if kv_capacity is not None and self.pool.block_size:
            check_kv_capacity(len(ids), max_tokens, params.n,
                              block_size=self.pool.block_size, capacity_tokens=kv_capacity)
        remaining = context.time_remaining()
        timeout_s = self.config.request_timeout_s if remaining is None else remaining
        prepared = PreparedRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling=sampling,
            n=params.n,
            max_tokens=max_tokens,
            cache_salt=request.cache_salt,
            priority=request.priority,
            stream=request.stream,
            received_at=received,
            deadline=received + timeout_s,
            tokenize_ms=tokenize_ms,
        )
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes(
                gen_ai_request_attributes(
                    self.config.model_name, params, input_tokens=len(ids), max_tokens=max_tokens
                )
            )
            span.set_attribute("pdmesh.tokenize_ms", tokenize_ms)
        budget = budget_tokens(len(ids), max_tokens, params.n)
        wait_s = prepared.deadline - time.monotonic()
        with get_tracer().start_as_current_span(
            "pdmesh.router.admission", attributes={"pdmesh.admission.budget_tokens": budget}
        ) as admission_span:
            queued = time.monotonic()
            ticket = await self.admission.acquire(budget, timeout_s=wait_s)
            queue_s = time.monotonic() - queued
            self.metrics.queue_time.observe(queue_s)
            admission_span.set_attributes(
                {
                    "pdmesh.queue_ms": queue_s * 1e3,
                    "pdmesh.admission.running": self.admission.running,
                    "pdmesh.admission.queued": self.admission.queued,
                }
            )
        async with ticket:
            await self.orchestrator.run(prepared, context.write)

    def _check_model(self, model: str) -> None:
        if model and model != self.config.model_name:
            raise RouteError(
                grpc.StatusCode.NOT_FOUND,
                f"model {model!r} is not served here; served: {self.config.model_name!r}",
            )

    # -- the small RPCs ----------------------------------------------------------------------
    async def Tokenize(
        self, request: router_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.TokenizeResponse:
        try:
            self._check_model(request.model)
            ids = await self.tokenizer.encode(request)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RouteError as exc:
            await context.abort(exc.code, str(exc))
        return router_pb2.TokenizeResponse(
            token_ids=ids, max_model_len=self.pool.max_model_len() or 0
        )

    async def Detokenize(
        self, request: router_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.DetokenizeResponse:
        try:
            self._check_model(request.model)
            text, strs = await self.tokenizer.decode(request.token_ids)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RouteError as exc:
            await context.abort(exc.code, str(exc))
        return router_pb2.DetokenizeResponse(text=text, token_strs=strs)

    async def ListModels(
        self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListModelsResponse:
        live = [i for i in self.pool.instances() if i.healthy]
        if not live:
            return router_pb2.ListModelsResponse()
        model = router_pb2.ModelInfo(
            id=self.config.model_name,
            max_model_len=self.pool.max_model_len() or 0,
            num_instances=len(live),
        )
        return router_pb2.ListModelsResponse(models=[model])

    async def GetStatus(
        self, request: router_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouterStatus:
        servable = self.pool.servability()
        return router_pb2.RouterStatus(
            serving=servable.serving,
            serving_detail=servable.detail,
            routing_policy=self.config.routing_policy,
            prefix_index_available=self.pool.index_available,
            prefix_index_detail=self.pool.index_detail,
            instances=[
                router_pb2.InstanceStatus(
                    instance_id=i.instance_id,
                    address=i.address,
                    role=_ROLES[i.role],
                    healthy=i.healthy,
                    detail=i.detail,
                    load=i.load,
                    num_inflight=i.inflight_requests,
                )
                for i in self.pool.instances()
            ],
            num_running=self.admission.running,
            num_queued=self.admission.queued,
        )


@dataclass
class _CallStatus:
    """The status one Generate call ends with, counted once, as soon as it is known: an abort
    sends the status to the client before the handler unwinds, and the client may read the
    metrics right after it."""

    count: Callable[[str], None]
    code: grpc.StatusCode = grpc.StatusCode.OK
    counted: bool = False

    def settle(self, code: grpc.StatusCode) -> None:
        self.code = code
        if not self.counted:
            self.counted = True
            self.count(code.name)


async def _abort(
    context: grpc.aio.ServicerContext,
    status: _CallStatus,
    code: grpc.StatusCode,
    details: str,
    trailing_metadata: tuple[tuple[str, str], ...] = (),
) -> None:
    """Abort the call, noting the status for the metrics and the current span first."""
    status.settle(code)
    span = trace.get_current_span()
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    mark_error(span, f"{code.name}: {details}")
    await context.abort(code, details, trailing_metadata=trailing_metadata)


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
    tokenizer = await asyncio.to_thread(
        PromptTokenizer, config.model_source, config.tokenizer_pool_size, config.chat_template
    )
    defaults = load_generation_defaults(config.generation_config,
                                        resolve_model(config.model_source))
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
        migration_limit=config.migration_limit,
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
