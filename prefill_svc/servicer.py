"""The Prefill gRPC service: compute a prompt's KV and first token(s), then lend the KV.

After the engine exports a request (its blocks pinned), the KV is copied out and published
through the `KVSender` under a lease. The pinned blocks are released exactly once, by the
sender's `on_release` (decode acked, failed, lease expired, cancelled via ReleaseKV/Abort,
shutdown). Every path that never reaches `publish` (cancelled call, read failure, a request
whose every sequence already finished) releases them itself.

`PrefillStream` lends the KV while the prompt is computed (chunked prefill): its messages come
from `streamed.py` (the growing export's handle, then the response with the sealed handle).

Each call is one `pdmesh.prefill` span (parent: the router's, from the gRPC metadata) with
`pdmesh.prefill.queue` and `pdmesh.prefill.compute` children timed from the engine's own
clock, and one observation in the engine metrics.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import grpc

from pdmesh.engine.core.stopping import first_token_finish
from pdmesh.engine.engine_request import KVCacheFullError
from pdmesh.engine.frontend.async_engine import EngineError
from pdmesh.engine.outputs import RequestOutput
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine_svc.codec import DeltaBuilder, prompt_logprobs_to_proto, sampling_from_proto
from pdmesh.engine_svc.export_layout import export_layout
from pdmesh.engine_svc.kv_peer import peer_prefix_pull, prefix_result
from pdmesh.engine_svc.service import EngineService
from pdmesh.kvstore.connector.export_info import ExportProgress
from pdmesh.kvstore.transfer.checksum import parse_algo
from pdmesh.kvstore.transfer.errors import KVTransferError
from pdmesh.kvstore.transfer.handle import log_id
from pdmesh.kvstore.transfer.sender import KVSender
from pdmesh.kvstore.transfer.state import ReleaseReason
from pdmesh.metrics import EngineMetrics, engine_metrics, failure_outcome
from pdmesh.prefill_svc.streamed import prefill_stream
from pdmesh.tracing import (
    Span,
    SpanKind,
    extract_metadata,
    gen_ai_request_attributes,
    gen_ai_response_attributes,
    get_tracer,
    monotonic_to_ns,
)
from pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, kv_transfer_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Published:
    transfer_id: str
    nbytes: int


class PrefillServicer(engine_pb2_grpc.PrefillServicer):
    def __init__(
        self, service: EngineService, sender: KVSender | None = None,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.service = service
        self.engine = service.engine
        self.sender = sender
        self.metrics = metrics or engine_metrics(service.role)
        self._lock = threading.Lock()
        self._published: dict[str, _Published] = {}

    # -- release (runs on any thread) --------------------------------------------------------
    def on_release(self, request_id: str, reason: ReleaseReason) -> None:
        with self._lock:
            self._published.pop(request_id, None)
        logger.debug("release request_id=%s reason=%s", request_id, reason)
        self.engine.release_kv_nowait(request_id)

    def on_sent(self, request_id: str, nbytes: int) -> None:
        """A decode instance acknowledged pulling `nbytes` of this request's KV."""
        self.service.counters.add_sent(nbytes)

    def remember_published(self, request_id: str, transfer_id: str, nbytes: int) -> None:
        """The request's KV is lent under `transfer_id` (ReleaseKV and Abort find it)."""
        with self._lock:
            self._published[request_id] = _Published(transfer_id, nbytes)

    def cancel_transfer(self, request_id: str, detail: str) -> bool:
        with self._lock:
            published = self._published.get(request_id)
        if published is None or self.sender is None:
            return False
        try:
            state = self.sender.cancel(published.transfer_id, detail)
        except KVTransferError:
            return False
        return state.name == "CANCELLED"

    # -- RPCs ----------------------------------------------------------------------------------
    async def Prefill(
        self, request: engine_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.PrefillResponse:
        received = time.monotonic()
        with get_tracer().start_as_current_span(
            "pdmesh.prefill", context=extract_metadata(context), kind=SpanKind.SERVER,
            attributes={"pdmesh.request_id": request.request_id,
                        "pdmesh.instance_id": self.service.instance_id},
        ) as span:
            try:
                response = await self._prefill(request, context, received, span)
            except BaseException as exc:
                self._count_failure(request, exc, received)
                raise
            return response

    def observe(
        self, span: Span, rid: str, prompt: list[int], out: RequestOutput,
        response: engine_pb2.PrefillResponse, received: float,
    ) -> None:
        """Metrics and span attributes of one finished prefill."""
        queue_s = out.metrics.get("queue_s")
        ttft_s = out.metrics.get("ttft_s")
        finishes = [common_pb2.FinishReason.Name(d.finish.reason).removeprefix("FINISH_REASON_")
                    .lower() for d in response.first if d.HasField("finish")]
        generated = sum(len(d.token_ids) for d in response.first)
        self.metrics.request_finished(
            outcome="exported" if response.HasField("kv") else (finishes or ["stop"])[0],
            prompt_tokens=len(prompt), generation_tokens=generated, ttft_s=ttft_s,
            e2e_s=time.monotonic() - received, queue_s=queue_s,
        )
        if not span.is_recording():
            return
        span.set_attributes(gen_ai_response_attributes(
            response_id=rid, output_tokens=generated, finish_reasons=finishes,
            input_tokens=len(prompt)))
        span.set_attributes({
            "pdmesh.cached_prompt_tokens": out.num_cached_tokens,
            "pdmesh.kv.published": response.HasField("kv"),
        })
        if response.HasField("kv"):
            span.set_attribute("pdmesh.kv.transfer", log_id(response.kv.transfer_id))
        if queue_s is None or ttft_s is None:
            return
        # The engine's clock: queued from arrival (~ `received`) until first scheduled, then
        # computing until the first token was sampled.
        tracer = get_tracer()
        scheduled = received + queue_s
        queue = tracer.start_span("pdmesh.prefill.queue", start_time=monotonic_to_ns(received))
        queue.set_attribute("pdmesh.queue_ms", queue_s * 1e3)
        queue.end(end_time=monotonic_to_ns(scheduled))
        compute = tracer.start_span("pdmesh.prefill.compute",
                                    start_time=monotonic_to_ns(scheduled))
        compute.set_attributes({"pdmesh.compute_ms": (ttft_s - queue_s) * 1e3,
                                "pdmesh.prompt_tokens": len(prompt),
                                "pdmesh.cached_prompt_tokens": out.num_cached_tokens})
        compute.end(end_time=monotonic_to_ns(received + ttft_s))

    async def checked(self, request: engine_pb2.PrefillRequest,
                       context: grpc.aio.ServicerContext, span: Span) -> SamplingParams:
        """The request's sampling parameters, or the call aborted with INVALID_ARGUMENT."""
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must be set")
        if not request.HasField("sampling"):  # unset max_tokens would run to the context end
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling: required")
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{exc}")
        if span.is_recording():
            span.set_attributes(gen_ai_request_attributes(
                self.service.config.model_name, params,
                input_tokens=len(request.prompt_token_ids)))
        return params

    async def run_export(
        self, request: engine_pb2.PrefillRequest, params: SamplingParams,
        context: grpc.aio.ServicerContext, span: Span,
        on_kv_progress: Callable[[ExportProgress], None] | None = None,
        failed: list[str] | None = None,
    ) -> RequestOutput:
        """The prompt run with `export_kv` (its leading blocks first pulled from the peer
        that lends them, `peer_prefix`); INVALID_ARGUMENT and the like abort the call."""
        peer = await peer_prefix_pull(self.service, request, params, context, span)
        out: RequestOutput | None = None
        try:
            out = await self.engine.prefill_export(
                request.request_id, {"prompt_token_ids": list(request.prompt_token_ids)},
                params, priority=request.priority, cache_salt=request.cache_salt or None,
                on_kv_progress=on_kv_progress,
                prefix_source=peer.source if peer is not None else None,
            )
            return out
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KVCacheFullError as exc:  # an export holds only its prompt: not expected
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineError as exc:
            if failed:  # a streamed export failed (preempted): the request was aborted
                await context.abort(grpc.StatusCode.ABORTED,
                                    f"the prefill's streamed export failed: {failed[0]}")
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        finally:
            if peer is not None:
                peer.settle(out, span)
        raise AssertionError("unreachable: context.abort raises")

    async def _prefill(
        self, request: engine_pb2.PrefillRequest, context: grpc.aio.ServicerContext,
        received: float, span: Span,
    ) -> engine_pb2.PrefillResponse:
        rid = request.request_id
        params = await self.checked(request, context, span)
        prompt = list(request.prompt_token_ids)
        out = await self.run_export(request, params, context, span)
        published = False
        try:
            response = self.response(rid, prompt, params, out, received)
            if all(d.HasField("finish") for d in response.first):
                await self.engine.release_kv(rid)  # nothing to continue: nothing to hold
            else:
                response.kv.CopyFrom(await self._publish(rid, out))
                published = True
        except BaseException:
            if not published:
                self.engine.release_kv_nowait(rid)
            else:
                self.cancel_transfer(rid, "prefill call failed before returning")
            raise
        response.timing.e2e_ms = (time.monotonic() - received) * 1e3
        self.observe(span, rid, prompt, out, response, received)
        return response

    # -- streamed: the KV lent while the prompt is computed ---------------------------------
    async def PrefillStream(
        self, request: engine_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.PrefillProgress]:
        """`Prefill` with the export growing chunk by chunk: first the handle, published
        when the core starts computing the prompt, then the response. The export's blocks are
        released exactly once, as `Prefill`'s are (on_release), or here when its transfer
        already ended."""
        received = time.monotonic()
        with get_tracer().start_as_current_span(
            "pdmesh.prefill", context=extract_metadata(context), kind=SpanKind.SERVER,
            attributes={"pdmesh.request_id": request.request_id,
                        "pdmesh.instance_id": self.service.instance_id,
                        "pdmesh.kv.streamed": True},
        ) as span:
            try:
                async for message in prefill_stream(self, request, context, received, span):
                    yield message
            except BaseException as exc:
                self._count_failure(request, exc, received)
                raise

    def _count_failure(self, request: engine_pb2.PrefillRequest, exc: BaseException,
                       received: float) -> None:
        self.metrics.request_finished(
            outcome=failure_outcome(exc), prompt_tokens=len(request.prompt_token_ids),
            generation_tokens=0, ttft_s=None, e2e_s=time.monotonic() - received, queue_s=None)

    async def _publish(self, rid: str, out: RequestOutput) -> kv_transfer_pb2.KVHandle:
        if self.sender is None:
            raise EngineError("this instance has no KV sender")
        export = out.kv_export
        assert export is not None
        if self.sender.core is not None:  # the core lends its blocks: no KV byte comes here
            info = await self.engine.export_kv(rid)
            layout = export_layout(self.engine.info, len(export.block_ids), export.num_tokens)
            handle = self.sender.publish_export(rid, layout, list(export.block_ids),
                                                info.block_checksums,
                                                parse_algo(info.checksum_algo))
            nbytes = layout.nbytes
        else:  # a sender whose core lends nothing: the KV comes here as one tensor
            kv = await self.engine.read_kv(rid)
            handle = await asyncio.to_thread(self.sender.publish, rid, kv, export.num_tokens)
            nbytes = kv.numel() * kv.element_size()
        self.remember_published(rid, handle.transfer_id, nbytes)
        return handle.to_proto()

    def response(
        self, rid: str, prompt: list[int], params: SamplingParams, out: RequestOutput,
        received: float,
    ) -> engine_pb2.PrefillResponse:
        builder = DeltaBuilder(params)
        response = engine_pb2.PrefillResponse(
            request_id=rid,
            cached_prompt_tokens=out.num_cached_tokens,
            instance_id=self.service.instance_id,
        )
        for completion in sorted(out.outputs, key=lambda c: c.index):
            finish = first_token_finish(
                completion.token_ids[0], len(prompt), params, self.engine.eos_token_ids,
                self.engine.max_model_len,
            ) if completion.token_ids else ("stop", None)  # no token left by its masks
            running = replace(completion, finish_reason=None, stop_reason=None)
            if finish is not None:
                running = replace(completion, finish_reason=finish[0], stop_reason=finish[1])
            delta = builder.delta(running) or common_pb2.SequenceDelta(index=completion.index)
            response.first.append(delta)
        if params.prompt_logprobs is not None:
            response.prompt_logprobs.extend(
                prompt_logprobs_to_proto(out.prompt_logprobs, prompt, params.prompt_logprobs)
            )
        if out.kv_load is not None:  # it came with a lent prefix: how its pull went
            response.peer_prefix.CopyFrom(prefix_result(out.kv_load))
        ttft_s = out.metrics.get("ttft_s", time.monotonic() - received)
        response.timing.prefill_ms = ttft_s * 1e3
        response.timing.ttft_ms = (time.monotonic() - received) * 1e3
        return response

    async def ReleaseKV(
        self, request: engine_pb2.ReleaseKVRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ReleaseKVResponse:
        with self._lock:
            published = self._published.get(request.request_id)
        if published is None or (request.transfer_id and
                                 request.transfer_id != published.transfer_id):
            return engine_pb2.ReleaseKVResponse(released=False)
        released = self.cancel_transfer(request.request_id, request.reason or "ReleaseKV")
        return engine_pb2.ReleaseKVResponse(released=released)

    async def Abort(
        self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.AbortResponse:
        cancelled = self.cancel_transfer(request.request_id, request.reason or "Abort")
        try:
            found = await self.engine.abort(request.request_id)
        except EngineError:  # the core is gone, and every request with it: nothing to abort
            found = False
        return engine_pb2.AbortResponse(found=found or cancelled)

    async def GetLoad(
        self, request: engine_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineLoad:
        return self.service.load()

    async def GetInfo(
        self, request: engine_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineInfo:
        return self.service.info()

