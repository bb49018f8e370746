"""The Decode gRPC service: continue a request after a remote prefill, or run it whole.

With `remote_prefill` the prompt's KV comes from the prefill instance (`remote_kv.py`: our
engine core pulls the blocks its prefix cache lacks straight from the prefill's core,
checksum-verified and acknowledged). When the pull fails (prefill gone or stopped, lease
expired, checksum mismatch, timeout) the fault is the prefill instance's: with
`--kv-load-failure-policy recompute` (default) this instance prefills the prompt itself and
continues after the prefill's first tokens, which the client already has (given tokens
without KV: same tokens, greedy or seeded), and says so in `DecodeResult.kv_load_fallback` so
the router charges the prefill instance; with `fail` the call is refused
(`refuse(..., "kv_load_failed")`). Without
`remote_prefill` the prompt is prefilled here (conditional disaggregation: the router decided
the prompt is mostly cached on this instance).
With `resume` (decode migration: the request's stream broke on another decode instance) the
prompt and each sequence's tokens so far are prefilled here and decoding continues exactly
after them. Every way ends in one `AsyncEngine.add` of an `EngineRequest` (the pulled KV, or
the tokens produced elsewhere, with it).
Deltas never repeat the prefill's first tokens; the last message is one DecodeResult.
A cancelled call aborts the request, which frees its blocks. A request that can never fit this
instance's KV pool is refused with RESOURCE_EXHAUSTED before its KV is pulled; one that fits
but finds the pool busy waits in the engine's scheduler.

A `streamed` remote prefill (Prefill.PrefillStream still running) starts its transfer at once
and follows the export as it grows; its first tokens come with `PrefillDone`
(`streamed.py`).

Each call is one `pdmesh.decode` span (parent: the router's, from the gRPC metadata) with the
KV pull as its `pdmesh.kv_transfer` child, and one observation in the engine metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from pdmesh.decode_svc.call import Admit, Observed, engine_request
from pdmesh.decode_svc.remote_kv import RemoteKV
from pdmesh.engine.engine_request import KVCacheFullError
from pdmesh.engine.frontend.async_engine import EngineError
from pdmesh.engine.outputs import RequestOutput
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine_svc.codec import (
    DeltaBuilder,
    prompt_logprobs_to_proto,
    sampling_from_proto,
)
from pdmesh.engine_svc.kv_peer import StartedPrefix, peer_prefix_pull, prefix_result
from pdmesh.engine_svc.service import EngineService
from pdmesh.kvstore.transfer.receiver import KVReceiver
from pdmesh.metrics import EngineMetrics, engine_metrics, failure_outcome
from pdmesh.tracing import (
    SpanKind,
    extract_metadata,
    gen_ai_request_attributes,
    gen_ai_response_attributes,
    get_tracer,
    mark_error,
)
from pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)


class DecodeServicer(engine_pb2_grpc.DecodeServicer):
    def __init__(
        self, service: EngineService, receiver: KVReceiver, *, kv_fetch_timeout_s: float = 30.0,
        kv_load_failure_policy: str = "recompute", metrics: EngineMetrics | None = None,
    ) -> None:
        self.service = service
        self.engine = service.engine
        self.receiver = receiver
        self.metrics = metrics or engine_metrics(service.role)
        self.remote = RemoteKV(self.engine, receiver, service.counters, self.metrics,
                               kv_fetch_timeout_s=kv_fetch_timeout_s,
                               kv_load_failure_policy=kv_load_failure_policy)

    async def Decode(
        self, request: engine_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.DecodeResponse]:
        # Spans are passed explicitly, never made current: this generator may be closed from
        # another context than the one it started in.
        span = get_tracer().start_span(
            "pdmesh.decode", context=extract_metadata(context), kind=SpanKind.SERVER,
            attributes={"pdmesh.request_id": request.request_id,
                        "pdmesh.instance_id": self.service.instance_id,
                        "pdmesh.decode.remote_prefill": request.HasField("remote_prefill"),
                        "pdmesh.decode.resumed": bool(request.resume)},
        )
        seen = Observed(span, prompt_tokens=len(request.prompt_token_ids))
        try:
            async for response in self._decode(request, context, seen):
                yield response
        except BaseException as exc:
            seen.outcome = failure_outcome(exc)
            mark_error(span, exc)
            raise
        finally:
            self._observe(request, seen)

    def _observe(self, request: engine_pb2.DecodeRequest, seen: Observed) -> None:
        e2e_s = time.monotonic() - seen.received
        self.metrics.request_finished(
            outcome=seen.outcome, prompt_tokens=seen.prompt_tokens,
            generation_tokens=seen.streamed_tokens, ttft_s=seen.ttft_s, e2e_s=e2e_s,
            queue_s=seen.queue_s,
        )
        span = seen.span
        if span.is_recording():
            span.set_attributes(gen_ai_response_attributes(
                response_id=request.request_id, output_tokens=seen.streamed_tokens,
                finish_reasons=seen.finish_reasons, input_tokens=seen.prompt_tokens,
            ))
            if seen.ttft_s is not None:
                span.set_attribute("pdmesh.decode.ttft_ms", seen.ttft_s * 1e3)
            if seen.queue_s is not None:
                span.set_attribute("pdmesh.queue_ms", seen.queue_s * 1e3)
            span.set_attribute("pdmesh.outcome", seen.outcome)
        span.end()

    async def _decode(
        self, request: engine_pb2.DecodeRequest, context: grpc.aio.ServicerContext,
        seen: Observed,
    ) -> AsyncIterator[engine_pb2.DecodeResponse]:
        received = seen.received
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must be set")
        if not request.HasField("sampling"):  # unset max_tokens would run to the context end
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling: required")
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{exc}")
        prompt = list(request.prompt_token_ids)
        if seen.span.is_recording():
            seen.span.set_attributes(gen_ai_request_attributes(
                self.service.config.model_name, params, input_tokens=len(prompt)))
        builder = DeltaBuilder(params)
        timing = common_pb2.Timing()
        remote = request.remote_prefill if request.HasField("remote_prefill") else None
        if remote is not None and request.resume:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "resume: a resumed request has no remote_prefill")
        if remote is not None and not remote.HasField("kv"):
            # Every sequence finished on the prefill instance: only the summary is left.
            seen.outcome = "finished_on_prefill"
            yield self._result(prompt, params, remote, None, received, timing)
            return
        try:  # before the KV is pulled or anything allocated
            self.engine.check_kv_capacity(len(prompt), params)
        except KVCacheFullError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        prefix: StartedPrefix | None = None
        if (remote is not None or request.resume) and request.HasField("peer_prefix"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "peer_prefix: only a request prefilled here takes a lent prefix")
        if remote is not None:
            admit = await self.remote.admit(request, params, remote, builder, context, timing,
                                               seen)
        elif request.resume:
            admit = await self._resume(request, params, builder, context)
        else:  # prefilled here, its leading blocks perhaps pulled from a peer that lends them
            prefix = await peer_prefix_pull(self.service, request, params, context, seen.span)
            admit = Admit(engine_request(
                request, params, prefix_source=prefix.source if prefix is not None else None))
        added = asyncio.Event()
        outputs = self.engine.add(admit.request, given_logprobs=admit.given_logprobs,
                                  added=added)
        streamed = admit.streamed
        if streamed is not None:
            assert admit.pull is not None
            streamed.start(self.engine, admit.pull, added)
        last: RequestOutput | None = None
        finished = False
        # Prefilled here: the prompt's logprobs go out before the first delta (DecodeResponse).
        prompt_k = params.prompt_logprobs if remote is None else None
        try:
            async for out in outputs:
                last = out
                if admit.pull is not None and not admit.pull.ending:
                    await self.remote.settle(admit.pull, out.kv_load, context, timing, seen)
                if prefix is not None:
                    prefix.settle(out, seen.span)
                if prompt_k is not None and out.prompt_logprobs is not None:
                    entries = prompt_logprobs_to_proto(out.prompt_logprobs, prompt, prompt_k)
                    prompt_k = None
                    yield engine_pb2.DecodeResponse(
                        prompt_logprobs=common_pb2.PromptLogprobs(entries=entries))
                if remote is None and not timing.prefill_ms and out.metrics.get("ttft_s"):
                    timing.prefill_ms = out.metrics["ttft_s"] * 1e3
                if seen.queue_s is None:
                    seen.queue_s = out.metrics.get("queue_s")
                for completion in sorted(out.outputs, key=lambda c: c.index):
                    delta = builder.delta(completion)
                    if delta is not None:
                        if timing.ttft_ms == 0.0:
                            timing.ttft_ms = (time.monotonic() - received) * 1e3
                            seen.ttft_s = timing.ttft_ms / 1e3
                        seen.streamed_tokens += len(delta.token_ids)
                        now = time.monotonic()
                        if seen.last_delta_at is not None:
                            self.metrics.inter_token(now - seen.last_delta_at)
                        seen.last_delta_at = now
                        yield engine_pb2.DecodeResponse(delta=delta)
            finished = True
            if last is not None:
                seen.finish_reasons = [c.finish_reason or "" for c in last.outputs]
                seen.outcome = seen.finish_reasons[0] if seen.finish_reasons else "stop"
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KVCacheFullError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        finally:
            if not finished:  # cancelled or failed: free its blocks now (only this call's
                await outputs.aclose()  # request: a newer call of the same id is not hit)
            if admit.pull is not None:
                self.remote.pulls.abandon(admit.pull, "the decode call ended before its pull")
            if prefix is not None:
                prefix.settle(None, seen.span)
            if streamed is not None:
                self.remote.streamed.unregister(streamed)
                await streamed.stop()
        if streamed is not None:
            remote = streamed.remote or remote
        response = self._result(prompt, params, remote, last, received, timing,
                                kv_load_fallback=seen.kv_load_fallback)
        if prefix is not None and last is not None and last.kv_load is not None:
            response.result.peer_prefix.CopyFrom(prefix_result(last.kv_load))
        yield response

    async def _resume(
        self,
        request: engine_pb2.DecodeRequest,
        params: SamplingParams,
        builder: DeltaBuilder,
        context: grpc.aio.ServicerContext,
    ) -> Admit:
        """Decode migration (DecodeRequest.resume): continue the sequences another instance
        was decoding. The engine prefills prompt + each sequence's tokens here and continues
        after them; the builder starts from what the client already has, so nothing repeats."""
        resumed = sorted(request.resume, key=lambda r: r.index)
        if [r.index for r in resumed] != list(range(params.n)):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"resume: expected one entry for each of {params.n} sequences",
            )
        for r in resumed:
            builder.seed(r.index, len(r.token_ids), r.text, done=r.finished)
        return Admit(engine_request(request, params,
                                      given_tokens=[list(r.token_ids) for r in resumed]))

    def _result(
        self,
        prompt: list[int],
        params: SamplingParams,
        remote: engine_pb2.RemotePrefill | None,
        last: RequestOutput | None,
        received: float,
        timing: common_pb2.Timing,
        *,
        kv_load_fallback: str = "",
    ) -> engine_pb2.DecodeResponse:
        result = engine_pb2.DecodeResult(instance_id=self.service.instance_id,
                                         kv_load_fallback=kv_load_fallback)
        result.usage.prompt_tokens = len(prompt)
        if last is not None:
            result.usage.completion_tokens = sum(len(c.token_ids) for c in last.outputs)
        elif remote is not None:
            result.usage.completion_tokens = sum(len(d.token_ids) for d in remote.first)
        if remote is not None and not kv_load_fallback:
            result.usage.cached_prompt_tokens = remote.cached_prompt_tokens
        elif remote is not None:  # recomputed here: this instance's own prefix-cache hit
            if last is not None:
                result.usage.cached_prompt_tokens = min(last.num_cached_tokens, len(prompt))
        elif last is not None:
            # min(): a resumed request's prefix hits may reach into its given output tokens.
            result.usage.cached_prompt_tokens = min(last.num_cached_tokens, len(prompt))
            if params.prompt_logprobs is not None:
                result.prompt_logprobs.extend(
                    prompt_logprobs_to_proto(last.prompt_logprobs, prompt, params.prompt_logprobs)
                )
        now = time.monotonic()
        timing.e2e_ms = (now - received) * 1e3
        if timing.ttft_ms:
            timing.decode_ms = timing.e2e_ms - timing.ttft_ms
        result.timing.CopyFrom(timing)
        return engine_pb2.DecodeResponse(result=result)

    async def PrefillDone(
        self, request: engine_pb2.PrefillDoneRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.PrefillDoneResponse:
        """The first tokens of a streamed Decode call (`streamed.py` hands them on)."""
        problem = self.remote.streamed.give(request.request_id, request.remote_prefill)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        return engine_pb2.PrefillDoneResponse(accepted=True)

    async def Abort(
        self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.AbortResponse:
        try:
            found = await self.engine.abort(request.request_id)
        except EngineError:  # the core is gone, and every request with it: nothing to abort
            found = False
        return engine_pb2.AbortResponse(found=found)

    async def GetLoad(
        self, request: engine_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineLoad:
        return self.service.load()

    async def GetInfo(
        self, request: engine_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineInfo:
        return self.service.info()
