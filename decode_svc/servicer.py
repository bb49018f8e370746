"""The Decode gRPC service: continue a request after a remote prefill, or run it whole.

With `remote_prefill` the KV is pulled straight from the prefill instance (`KVReceiver`,
checksum-verified and acknowledged) before the request enters the engine; a failed pull is a
clear UNAVAILABLE status and nothing is decoded. Without it the prompt is prefilled here
(conditional disaggregation: the router decided the prompt is mostly cached on this instance).
Deltas never repeat the prefill's first tokens; the last message is one DecodeResult.
A cancelled call aborts the request, which frees its blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc

from pdmesh.decode_svc.convert import (
    DeltaBuilder,
    logprob_from_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
)
from pdmesh.decode_svc.engine_service import EngineService
from pdmesh.engine.async_engine import EngineError
from pdmesh.engine.llm_engine import KVCacheFullError
from pdmesh.engine.outputs import RequestOutput, TokenLogprobs
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.kvstore.transfer import KVHandle, KVHandleError, KVReceiver, KVTransferError
from pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)


class DecodeServicer(engine_pb2_grpc.DecodeServicer):
    def __init__(
        self, service: EngineService, receiver: KVReceiver, *, kv_fetch_timeout_s: float = 30.0
    ) -> None:
        self.service = service
        self.engine = service.engine
        self.receiver = receiver
        self.kv_fetch_timeout_s = kv_fetch_timeout_s

    async def Decode(
        self, request: engine_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.DecodeResponse]:
        received = time.monotonic()
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must be set")
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{exc}")
        prompt = list(request.prompt_token_ids)
        builder = DeltaBuilder(params)
        timing = common_pb2.Timing()
        remote = request.remote_prefill if request.HasField("remote_prefill") else None
        if remote is not None and not remote.HasField("kv"):
            # Every sequence finished on the prefill instance: only the summary is left.
            yield self._result(prompt, params, remote, None, received, timing)
            return
        if remote is not None:
            outputs = await self._import(request, params, remote, builder, context, timing)
        else:
            outputs = self.engine.generate(
                rid, {"prompt_token_ids": prompt}, params,
                priority=request.priority, cache_salt=request.cache_salt or None,
            )
        last: RequestOutput | None = None
        finished = False
        try:
            async for out in outputs:
                last = out
                if remote is None and not timing.prefill_ms and out.metrics.get("ttft_s"):
                    timing.prefill_ms = out.metrics["ttft_s"] * 1e3
                for completion in sorted(out.outputs, key=lambda c: c.index):
                    delta = builder.delta(completion)
                    if delta is not None:
                        if timing.ttft_ms == 0.0:
                            timing.ttft_ms = (time.monotonic() - received) * 1e3
                        yield engine_pb2.DecodeResponse(delta=delta)
            finished = True
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KVCacheFullError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"KV cache full: {exc}")
        except EngineError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        finally:
            if not finished:
                self.engine.abort_nowait(rid)  # cancelled or failed: free its blocks now
        yield self._result(prompt, params, remote, last, received, timing)

    async def _import(
        self,
        request: engine_pb2.DecodeRequest,
        params: SamplingParams,
        remote: engine_pb2.RemotePrefill,
        builder: DeltaBuilder,
        context: grpc.aio.ServicerContext,
        timing: common_pb2.Timing,
    ) -> AsyncIterator[RequestOutput]:
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        try:
            handle = KVHandle.from_proto(remote.kv)
        except KVHandleError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"remote_prefill.kv: {exc}")
        if handle.request_id != rid:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"remote_prefill.kv: handle belongs to request {handle.request_id!r}, not {rid!r}",
            )
        first = sorted(remote.first, key=lambda d: d.index)
        if [d.index for d in first] != list(range(params.n)) or any(
            len(d.token_ids) != 1 for d in first
        ):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"remote_prefill.first: expected one token for each of {params.n} sequences",
            )
        first_ids = [d.token_ids[0] for d in first]
        first_logprobs: list[TokenLogprobs | None] | None = None
        if params.logprobs is not None:
            first_logprobs = [logprob_from_proto(d.logprobs[0]) if d.logprobs else None
                              for d in first]
        for d in first:
            builder.seed(d.index, len(d.token_ids), d.text, done=d.HasField("finish"))
        started = time.monotonic()
        try:
            kv = await self.receiver.fetch(handle, self.kv_fetch_timeout_s)
        except KVTransferError as exc:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"KV transfer from {handle.sender_address} failed "
                f"({type(exc).__name__}): {exc}",
            )
        timing.kv_transfer_ms = (time.monotonic() - started) * 1e3
        self.service.counters.add_received(kv.numel() * kv.element_size())
        return self.engine.import_and_decode(
            rid, prompt, first_ids, kv, params,
            first_logprobs=first_logprobs,
            priority=request.priority,
            cache_salt=request.cache_salt or None,
            num_cached_tokens=remote.cached_prompt_tokens,
        )

    def _result(
        self,
        prompt: list[int],
        params: SamplingParams,
        remote: engine_pb2.RemotePrefill | None,
        last: RequestOutput | None,
        received: float,
        timing: common_pb2.Timing,
    ) -> engine_pb2.DecodeResponse:
        result = engine_pb2.DecodeResult(instance_id=self.service.instance_id)
        result.usage.prompt_tokens = len(prompt)
        if last is not None:
            result.usage.completion_tokens = sum(len(c.token_ids) for c in last.outputs)
        elif remote is not None:
            result.usage.completion_tokens = sum(len(d.token_ids) for d in remote.first)
        if remote is not None:
            result.usage.cached_prompt_tokens = remote.cached_prompt_tokens
        elif last is not None:
            result.usage.cached_prompt_tokens = last.num_cached_tokens
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

    async def Abort(
        self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.AbortResponse:
        return engine_pb2.AbortResponse(found=await self.engine.abort(request.request_id))

    async def GetLoad(
        self, request: engine_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineLoad:
        return self.service.load()

    async def GetInfo(
        self, request: engine_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineInfo:
        return self.service.info()
