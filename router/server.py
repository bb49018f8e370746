"""The Router gRPC service (`pdmesh router`): the cluster's only public front door.

Generate = prepare (validate and tokenize, `router/prepare.py`) → admit (budget) → route and
run (orchestrator) → stream back.
The process around the service (start-up, health mirroring, drain, teardown) is
`router/process.py`.
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
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from pdmesh.engine.generation_config import GenerationDefaults
from pdmesh.router.admission import (
    RETRY_AFTER_KEY,
    Admission,
    DeadlineExpired,
    ExceedsKVCapacity,
    InvalidRequest,
    OverCapacity,
    budget_tokens,
    retry_after_ms,
)
from pdmesh.router.config import RouterConfig
from pdmesh.router.failures import RouteError
from pdmesh.router.grammar_check import GrammarCheck
from pdmesh.router.instances import InstancePool
from pdmesh.router.orchestrator import Orchestrator
from pdmesh.router.prepare import RequestPreparer, check_model
from pdmesh.router.prompt_tokenizer import PromptTokenizer
from pdmesh.router.queue_delay import QueueDelay, Worker
from pdmesh.router.request import PreparedRequest
from pdmesh.router.request_log import RequestLog
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
        self.tokenizer = tokenizer
        self.pool = pool
        self.orchestrator = orchestrator
        self.metrics = orchestrator.metrics
        self.admission = Admission(config.admission_limits())
        self.queue_delay = QueueDelay(config.max_queue_delay_s)
        self.grammars = GrammarCheck(tokenizer.model_dir, tokenizer.vocab_size,
                                     config.structured_output_compile_timeout_s)
        # Sampling defaults for what a request leaves unset (engine/generation_config.py).
        self.preparer = RequestPreparer(config, defaults or GenerationDefaults(), tokenizer,
                                        self.grammars, pool)
        self._inflight: set[str] = set()
        self.request_log = RequestLog.from_flags(
            config.enable_log_requests, config.enable_log_outputs, config.max_log_len)

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
        rejected = self.metrics.admission_rejections
        if not _valid_request_id(request_id):
            # Before anything is sent: the id goes out as metadata, where gRPC allows only
            # printable ASCII (anything else would fail the call with INTERNAL).
            rejected.labels("invalid_argument").inc()
            await _abort(context, status, grpc.StatusCode.INVALID_ARGUMENT,
                         f"request_id: must be printable ASCII and at most "
                         f"{MAX_REQUEST_ID_BYTES} bytes")
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
        prepared, params = await self.preparer.prepare(request, request_id, received,
                                                       context.time_remaining())
        ids, max_tokens = prepared.prompt_token_ids, prepared.max_tokens
        if self.request_log is not None:
            self.request_log.received(request_id, ids, max_tokens, prepared.sampling)
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes(
                gen_ai_request_attributes(
                    self.config.model_name, params, input_tokens=len(ids), max_tokens=max_tokens
                )
            )
            span.set_attribute("pdmesh.tokenize_ms", prepared.tokenize_ms)
        budget = budget_tokens(len(ids), max_tokens, params.n, self.pool.block_size)
        workers = self._workers()
        self.queue_delay.observe(workers)
        self.queue_delay.admit(len(ids), workers)  # OverCapacity when it would wait too long
        if request.send_accepted:
            await context.write(router_pb2.GenerateResponse(accepted=router_pb2.Accepted()))
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
            await self._run_counting_backlog(prepared, context)

    async def _run_counting_backlog(self, prepared: PreparedRequest,
                                    context: grpc.aio.ServicerContext) -> None:
        """Run the request with its prompt on the queue-delay backlog until its first output
        (or its end, whichever comes first)."""
        prompt = len(prepared.prompt_token_ids)
        self.queue_delay.started(prompt)
        waiting = True
        output = (self.request_log.output(prepared.request_id)
                  if self.request_log is not None else None)

        async def write(message: router_pb2.GenerateResponse) -> None:
            nonlocal waiting
            if waiting:
                waiting = False
                self.queue_delay.first_token(prompt)
            if output is not None:
                output.saw(message)
            await context.write(message)

        try:
            await self.orchestrator.run(prepared, write)
        finally:
            if waiting:
                self.queue_delay.first_token(prompt)

    def _workers(self) -> list[Worker]:
        return [Worker(i.address, i.role == "prefill", i.healthy, i.load.scheduled_tokens,
                       i.load.step_seconds, i.load.model_prefill_tokens_per_s)
                for i in self.pool.instances()]

    # -- the small RPCs ----------------------------------------------------------------------
    async def Tokenize(
        self, request: router_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.TokenizeResponse:
        try:
            check_model(request.model, self.config.model_names)
            ids = await self.tokenizer.encode(request, context_len=self.pool.max_model_len())
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
            check_model(request.model, self.config.model_names)
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
        return router_pb2.ListModelsResponse(models=[
            router_pb2.ModelInfo(id=name, max_model_len=self.pool.max_model_len() or 0,
                                 num_instances=len(live))
            for name in self.config.model_names])

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


def _valid_request_id(request_id: str) -> bool:
    return (request_id.isascii() and request_id.isprintable()
            and len(request_id) <= MAX_REQUEST_ID_BYTES)


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
