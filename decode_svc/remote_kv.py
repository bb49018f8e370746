"""A remote prefill's KV into this decode instance's engine.

Two ways, chosen by the handle:

* an export (`KVHandle.is_export`: the prefill's engine core lends its blocks): start the
  transfer on the prefill's control plane (`KVReceiver.begin`: capability, lease, one-time
  grant) and hand the request to our engine with a `KVSource`; our core pulls the blocks its
  prefix cache lacks itself, and its first output says how that went (`settle`): the ack or
  the failure goes back to the prefill, the blocks pulled and reused are counted;
* a staged tensor (a prefill whose core lends nothing): pull it here (`KVReceiver.fetch`) and
  hand it over.

A pull that fails is the prefill instance's fault: with `--kv-load-failure-policy recompute`
the prompt is prefilled here and decoding continues after the prefill's first tokens (same
tokens); with `fail` the call is refused (`refuse(..., "kv_load_failed")`).
"""

from __future__ import annotations

import logging
import time

import grpc

from pdmesh.decode_svc.call import Admit, Observed, engine_request
from pdmesh.decode_svc.streamed import StreamedCalls, StreamedPrefill
from pdmesh.engine.frontend.async_engine import AsyncEngine
from pdmesh.engine.outputs import TokenLogprobs
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine_svc.codec import DeltaBuilder, logprob_from_proto
from pdmesh.engine_svc.core_source import start_core_pull
from pdmesh.engine_svc.service import KVCounters
from pdmesh.grpc_common import KV_LOAD_FAILED, refuse
from pdmesh.kvstore.connector.source import LoadResult
from pdmesh.kvstore.transfer.capability import TransferCapability
from pdmesh.kvstore.transfer.core_pull import CorePulls, Pull
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import KVHandleError, KVTransferError
from pdmesh.kvstore.transfer.errors import failure_outcome as kv_failure_reason
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.receiver import KVReceiver
from pdmesh.metrics import EngineMetrics
from pdmesh.tracing import span_traceparent
from pdmesh.v1 import common_pb2, engine_pb2

logger = logging.getLogger(__name__)


class RemoteKV:
    def __init__(self, engine: AsyncEngine, receiver: KVReceiver, counters: KVCounters,
                 metrics: EngineMetrics, *, kv_fetch_timeout_s: float,
                 kv_load_failure_policy: str) -> None:
        if kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"kv_load_failure_policy: expected recompute or fail, got "
                             f"{kv_load_failure_policy!r}")
        self.engine = engine
        self.receiver = receiver
        self.pulls = CorePulls(receiver)
        self.counters = counters
        self.metrics = metrics
        self.kv_fetch_timeout_s = kv_fetch_timeout_s
        self.kv_load_failure_policy = kv_load_failure_policy
        self.streamed = StreamedCalls()  # streamed Decode calls, for Decode.PrefillDone

    async def admit(
        self,
        request: engine_pb2.DecodeRequest,
        params: SamplingParams,
        remote: engine_pb2.RemotePrefill,
        builder: DeltaBuilder,
        context: grpc.aio.ServicerContext,
        timing: common_pb2.Timing,
        seen: Observed,
    ) -> Admit:
        """The pulled KV with the prefill's first tokens (or, when the pull fails, those
        tokens alone: `_recompute`)."""
        rid = request.request_id
        span = seen.span
        try:
            handle = KVHandle.from_proto(remote.kv)
        except KVHandleError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"remote_prefill.kv: {exc}")
        if handle.request_id != rid:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"remote_prefill.kv: handle belongs to request {handle.request_id!r}, not {rid!r}",
            )
        if remote.streamed:  # the prefill still runs: its first tokens come later
            if not handle.is_export:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "remote_prefill.kv: a streamed prefill lends an export")
            capability = (TransferCapability.from_proto(remote.capability)
                          if remote.HasField("capability") else None)
            return await self._begin_stream(request, params, handle, builder, capability,
                                            context, seen)
        first = sorted(remote.first, key=lambda d: d.index)
        if [d.index for d in first] != list(range(params.n)) or any(
            len(d.token_ids) != 1 for d in first
        ):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"remote_prefill.first: expected one token for each of {params.n} sequences",
            )
        first_ids = [[d.token_ids[0]] for d in first]
        first_logprobs: list[list[TokenLogprobs | None]] | None = None
        if params.logprobs is not None:
            first_logprobs = [[logprob_from_proto(d.logprobs[0]) if d.logprobs else None]
                              for d in first]
        for d in first:
            builder.seed(d.index, len(d.token_ids), d.text, done=d.HasField("finish"))
        capability = (TransferCapability.from_proto(remote.capability)
                      if remote.HasField("capability") else None)  # the router's grant
        if handle.is_export:  # the prefill's core lends its blocks: our core pulls them
            return await self._begin_pull(request, params, remote, handle, first_ids,
                                          first_logprobs, capability, context, seen)
        started = time.monotonic()
        try:
            kv = await self.receiver.fetch(
                handle, self.kv_fetch_timeout_s, traceparent=span_traceparent(span),
                capability=capability,
            )
        except KVTransferError as exc:
            reason = kv_failure_reason(exc)
            message = (f"KV transfer from {handle.sender_address} failed "
                       f"({type(exc).__name__}): {exc}")
            if self.kv_load_failure_policy == "fail":
                await refuse(context, KV_LOAD_FAILED, message)
            return self._recompute(request, params, first_ids, first_logprobs, reason,
                                   message, seen)
        timing.kv_transfer_ms = (time.monotonic() - started) * 1e3
        self.counters.add_received(kv.numel() * kv.element_size())
        if span.is_recording():
            span.set_attributes({"pdmesh.kv.transfer_ms": timing.kv_transfer_ms,
                                 "pdmesh.kv.bytes": kv.numel() * kv.element_size()})
        return Admit(engine_request(request, params, kv=kv, given_tokens=first_ids,
                                      num_cached_tokens=remote.cached_prompt_tokens),
                      first_logprobs)

    async def _begin_pull(
        self,
        request: engine_pb2.DecodeRequest,
        params: SamplingParams,
        remote: engine_pb2.RemotePrefill,
        handle: KVHandle,
        first_ids: list[list[int]],
        first_logprobs: list[list[TokenLogprobs | None]] | None,
        capability: TransferCapability | None,
        context: grpc.aio.ServicerContext,
        seen: Observed,
    ) -> Admit:
        """Start the transfer on the control plane; the engine core pulls the blocks its
        prefix cache lacks while it admits the request (`settle` hears how it went)."""
        deadline = Deadline.after(self.kv_fetch_timeout_s)
        try:
            source, pull = await start_core_pull(
                self.pulls, self.engine.info, handle, deadline,
                traceparent=span_traceparent(seen.span), capability=capability)
        except KVTransferError as exc:
            message = (f"KV transfer from {handle.sender_address} failed "
                       f"({type(exc).__name__}): {exc}")
            if self.kv_load_failure_policy == "fail":
                await refuse(context, KV_LOAD_FAILED, message)
            return self._recompute(request, params, first_ids, first_logprobs,
                                   kv_failure_reason(exc), message, seen)
        return Admit(engine_request(request, params, given_tokens=first_ids,
                                      num_cached_tokens=remote.cached_prompt_tokens,
                                      kv_source=source),
                      first_logprobs, pull)

    async def _begin_stream(
        self,
        request: engine_pb2.DecodeRequest,
        params: SamplingParams,
        handle: KVHandle,
        builder: DeltaBuilder,
        capability: TransferCapability | None,
        context: grpc.aio.ServicerContext,
        seen: Observed,
    ) -> Admit:
        """Start the transfer of a growing export now; our core pulls each batch of blocks
        as the sender reports it (`streamed.py`). A transfer that cannot start fails like any
        pull: refused under `fail`, else the prompt is recomputed here once the first tokens
        came (the caller's cleanup unregisters the call)."""
        # The lease, its heartbeat and the progress stream live as long as the call may (a
        # long prompt's prefill outlasts the fetch timeout); each batch's pull is bounded by
        # the fetch timeout.
        deadline = Deadline.after(max(self.kv_fetch_timeout_s, context.time_remaining() or 0.0))
        streamed = StreamedPrefill(request.request_id, params, builder)
        self.streamed.register(streamed)
        try:
            source, pull = await start_core_pull(
                self.pulls, self.engine.info, handle, deadline,
                traceparent=span_traceparent(seen.span), capability=capability,
                source_deadline_s=self.kv_fetch_timeout_s,
                start_deadline=Deadline.after(self.kv_fetch_timeout_s), streamed=True)
        except KVTransferError as exc:
            message = (f"streamed KV transfer from {handle.sender_address} could not start "
                       f"({type(exc).__name__}): {exc}")
            if self.kv_load_failure_policy == "fail":
                self.streamed.unregister(streamed)
                await refuse(context, KV_LOAD_FAILED, message)
            try:
                remote = await streamed.first  # Decode.PrefillDone; cancelled with the call
            finally:
                self.streamed.unregister(streamed)
            first = sorted(remote.first, key=lambda d: d.index)
            for d in first:
                builder.seed(d.index, len(d.token_ids), d.text, done=d.HasField("finish"))
            logprobs: list[list[TokenLogprobs | None]] | None = None
            if params.logprobs is not None:
                logprobs = [[logprob_from_proto(d.logprobs[0]) if d.logprobs else None]
                            for d in first]
            return self._recompute(request, params, [[d.token_ids[0]] for d in first],
                                   logprobs, kv_failure_reason(exc), message, seen)
        except BaseException:
            self.streamed.unregister(streamed)
            raise
        streamed.idle_s = self.kv_fetch_timeout_s
        return Admit(engine_request(request, params, kv_source=source), None, pull, streamed)

    async def settle(self, pull: Pull, result: LoadResult | None,
                     context: grpc.aio.ServicerContext, timing: common_pb2.Timing,
                     seen: Observed) -> None:
        """The core placed the request (its first output says how): settle the transfer, and
        count what was pulled and what the prefix cache already had."""
        if result is None:
            result = LoadResult(error="the engine reported no pull", reason="error")
        self.pulls.finish_soon(pull, nbytes=result.nbytes, error=result.error,
                               reason=result.reason)
        timing.kv_transfer_ms = result.seconds * 1e3
        self.metrics.kv_blocks(pulled=result.pulled_blocks, reused=result.reused_blocks)
        if result.streamed and not result.error:
            self.metrics.kv_stream(before_seal=result.pulled_before_seal,
                                   after_seal=result.pulled_blocks - result.pulled_before_seal)
        if seen.span.is_recording():
            seen.span.set_attributes({"pdmesh.kv.transfer_ms": timing.kv_transfer_ms,
                                      "pdmesh.kv.bytes": result.nbytes,
                                      "pdmesh.kv.blocks_pulled": result.pulled_blocks,
                                      "pdmesh.kv.blocks_reused": result.reused_blocks})
            if result.streamed:
                seen.span.set_attributes({"pdmesh.kv.streamed": True,
                                          "pdmesh.kv.blocks_before_seal":
                                              result.pulled_before_seal})
        if not result.error:
            self.counters.add_received(result.nbytes)
            return
        if result.reason == "no_free_blocks":
            return  # our pool is busy, not the prefill's fault: it recomputes when room frees
        message = f"KV pull from {pull.handle.sender_address} failed: {result.error}"
        if self.kv_load_failure_policy == "fail":
            await refuse(context, KV_LOAD_FAILED, message)
        self._fell_back(pull.handle.request_id, result.reason, message, seen)

    def _recompute(
        self,
        request: engine_pb2.DecodeRequest,
        params: SamplingParams,
        first_ids: list[list[int]],
        first_logprobs: list[list[TokenLogprobs | None]] | None,
        reason: str,
        message: str,
        seen: Observed,
    ) -> Admit:
        """The KV pull failed: prefill the prompt here and continue after the prefill's first
        tokens (already with the client), as the request would have continued."""
        self._fell_back(request.request_id, reason, message, seen)
        return Admit(engine_request(request, params, given_tokens=first_ids), first_logprobs)

    def _fell_back(self, request_id: str, reason: str, message: str, seen: Observed) -> None:
        """Record that this instance recomputes the prompt (the router charges the prefill)."""
        seen.kv_load_fallback = reason
        self.metrics.kv_load_fallback(reason)
        logger.warning("KV load failed, recomputing here request_id=%s reason=%s: %s",
                       request_id, reason, message)
        if seen.span.is_recording():
            seen.span.add_event("pdmesh.kv_load_fallback",
                                {"pdmesh.kv.failure_reason": reason, "message": message})
