"""What goes back to the client: the GenerateResponses of one request.

A streamed request (stream=true) gets every delta as it comes, its prompt logprobs once before
its first delta, and a final `GenerateResult`; an unstreamed one gets one collapsed delta per
sequence, then the result. The `Assembler` keeps everything handed on per sequence, which is
also what a migrated stream resumes from (router/recovery.py). Usage is the undisturbed run's
whatever happened on the way: the original prompt, every token produced, the original
prefill's cached-token count.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from pdmesh.metrics import RouterMetrics
from pdmesh.router.failures import RouteError
from pdmesh.router.request import Plan, PreparedRequest
from pdmesh.slo import RequestLatency, meets_slos
from pdmesh.tracing import gen_ai_response_attributes
from pdmesh.v1 import common_pb2, engine_pb2, router_pb2

Send = Callable[[router_pb2.GenerateResponse], Awaitable[None]]


@dataclass
class SequenceOutput:
    """One output sequence as handed on so far."""

    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish: common_pb2.Finish | None = None


class Assembler:
    """Collects the deltas of the n sequences: forwards them as they come (stream=true) or
    collapses them into one delta per sequence (stream=false)."""

    def __init__(self, n: int) -> None:
        self.sequences = [SequenceOutput() for _ in range(n)]

    def add(self, delta: common_pb2.SequenceDelta) -> None:
        if delta.index >= len(self.sequences):
            raise RouteError(grpc.StatusCode.INTERNAL, f"delta for unknown index {delta.index}")
        seq = self.sequences[delta.index]
        seq.token_ids.extend(delta.token_ids)
        seq.text.append(delta.text)
        seq.logprobs.extend(delta.logprobs)
        if delta.HasField("finish"):
            seq.finish = delta.finish

    @property
    def started(self) -> bool:
        return any(s.token_ids for s in self.sequences)

    @property
    def finished(self) -> bool:
        return all(s.finish is not None for s in self.sequences)

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    def fail_unfinished(self, message: str) -> list[common_pb2.SequenceDelta]:
        """Finish-only deltas ending every open sequence with FINISH_REASON_ERROR."""
        out = []
        for index, seq in enumerate(self.sequences):
            if seq.finish is None:
                seq.finish = common_pb2.Finish(
                    reason=common_pb2.FINISH_REASON_ERROR, message=message
                )
                out.append(common_pb2.SequenceDelta(index=index, finish=seq.finish))
        return out

    def collapsed(self) -> list[common_pb2.SequenceDelta]:
        return [
            common_pb2.SequenceDelta(
                index=index,
                token_ids=seq.token_ids,
                text="".join(seq.text),
                logprobs=seq.logprobs,
                finish=seq.finish,
            )
            for index, seq in enumerate(self.sequences)
        ]


def final_usage(req: PreparedRequest, completion_tokens: int,
                prefill: engine_pb2.PrefillResponse | None,
                result: engine_pb2.DecodeResult | None) -> common_pb2.Usage:
    """The request's usage as an undisturbed run reports it: the original prompt, every token
    produced, the original prefill's cached tokens (after a local prefill, the last decode
    instance's; none when it did not finish)."""
    if prefill is not None:
        cached = prefill.cached_prompt_tokens
    else:
        cached = result.usage.cached_prompt_tokens if result is not None else 0
    return common_pb2.Usage(
        prompt_tokens=len(req.prompt_token_ids),
        completion_tokens=completion_tokens,
        cached_prompt_tokens=cached,
    )


def final_prompt_logprobs(
    prefill: engine_pb2.PrefillResponse | None, result: engine_pb2.DecodeResult | None
) -> list[common_pb2.TokenLogprob]:
    """Prompt logprobs from whichever instance computed the prompt first."""
    if prefill is not None:
        return list(prefill.prompt_logprobs)
    return list(result.prompt_logprobs) if result is not None else []


def served_by(plan: Plan) -> router_pb2.ServedBy:
    decode_id = plan.decode.instance_id
    prefill_id = plan.prefill.instance_id if plan.prefill else decode_id
    return router_pb2.ServedBy(prefill_instance_id=prefill_id, decode_instance_id=decode_id)


def merge_timing(
    req: PreparedRequest, ttft_ms: float, parts: list[common_pb2.Timing]
) -> common_pb2.Timing:
    """The request's timing: the router's own, plus every instance's parts summed."""
    timing = common_pb2.Timing(
        tokenize_ms=req.tokenize_ms,
        ttft_ms=ttft_ms,
        e2e_ms=(time.monotonic() - req.received_at) * 1000,
    )
    for part in parts:
        timing.queue_ms += part.queue_ms
        timing.prefill_ms += part.prefill_ms
        timing.kv_transfer_ms += part.kv_transfer_ms
        timing.decode_ms += part.decode_ms
    return timing


def _finish_name(reason: int) -> str:
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


class ResponseStream:
    """One request's responses, through `send`; `sent` once a delta went to the client, from
    when on a failure can no longer be a status."""

    def __init__(self, req: PreparedRequest, send: Send, metrics: RouterMetrics,
                 slos: dict[str, float] | None = None) -> None:
        """`slos`: the router's goodput SLOs (`--goodput`, pdmesh/slo.py), in ms."""
        self.req = req
        self._send = send
        self.metrics = metrics
        self.slos = slos or {}
        self.out = Assembler(req.n)
        self.sent = False
        self.ttft_ms = 0.0
        self._last_token_at = 0.0
        self.max_itl_s = 0.0  # the longest gap between two deltas with tokens
        self.timings: list[common_pb2.Timing] = []  # each instance call's own
        self._prompt_logprobs_sent = False

    async def emit(self, delta: common_pb2.SequenceDelta) -> None:
        self.out.add(delta)
        if delta.token_ids:
            now = time.monotonic()
            if not self.ttft_ms:
                self.ttft_ms = (now - self.req.received_at) * 1000
            else:
                self.max_itl_s = max(self.max_itl_s, now - self._last_token_at)
            self._last_token_at = now
        if self.req.stream:
            self.sent = True
            await self._send(router_pb2.GenerateResponse(delta=delta))

    async def send_prompt_logprobs(self, entries: Iterable[common_pb2.TokenLogprob]) -> None:
        """A streamed request that asked for prompt logprobs gets them once, before its first
        delta, from whichever instance computed the prompt first (a re-routed or migrated
        decode computes them again: those are not sent)."""
        if not self.req.stream or self._prompt_logprobs_sent or \
                not self.req.sampling.HasField("prompt_logprobs"):
            return
        self._prompt_logprobs_sent = True
        await self._send(router_pb2.GenerateResponse(
            prompt_logprobs=common_pb2.PromptLogprobs(entries=entries)))

    async def fail_unfinished(self, message: str) -> None:
        """End every open sequence with FINISH_REASON_ERROR (the final message follows)."""
        for delta in self.out.fail_unfinished(message):
            if self.req.stream:
                await self._send(router_pb2.GenerateResponse(delta=delta))

    async def finish(self, usage: common_pb2.Usage,
                     prompt_logprobs: list[common_pb2.TokenLogprob],
                     served: router_pb2.ServedBy) -> None:
        """The final message (after the collapsed deltas of an unstreamed request)."""
        if not self.req.stream:
            for delta in self.out.collapsed():
                await self._send(router_pb2.GenerateResponse(delta=delta))
        result = router_pb2.GenerateResult(
            request_id=self.req.request_id,
            usage=usage,
            prompt_logprobs=prompt_logprobs,
            timing=merge_timing(self.req, self.ttft_ms, self.timings),
            served_by=served,
        )
        self._observe(result)
        await self._send(router_pb2.GenerateResponse(result=result))

    def _observe(self, result: router_pb2.GenerateResult) -> None:
        """Router metrics and the generate span's response attributes for one request."""
        m = self.metrics
        usage, timing = result.usage, result.timing
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.cached_prompt_tokens.inc(usage.cached_prompt_tokens)
        m.generation_tokens.inc(usage.completion_tokens)
        e2e_s = timing.e2e_ms / 1e3
        m.e2e.observe(e2e_s)
        if self.ttft_ms:
            latency = RequestLatency(self.ttft_ms / 1e3, e2e_s, usage.completion_tokens,
                                     self.max_itl_s)
            m.ttft.observe(latency.ttft_s)
            if usage.completion_tokens > 1:
                m.tpot.observe(latency.tpot_s)
            if self.slos and meets_slos(latency, self.slos):
                m.goodput_requests.inc()
        span = trace.get_current_span()
        if not span.is_recording():
            return
        finishes = [_finish_name(s.finish.reason) for s in self.out.sequences if s.finish]
        span.set_attributes(gen_ai_response_attributes(
            response_id=result.request_id, output_tokens=usage.completion_tokens,
            finish_reasons=finishes, input_tokens=usage.prompt_tokens,
        ))
        span.set_attributes({
            "pdmesh.cached_prompt_tokens": usage.cached_prompt_tokens,
            "pdmesh.ttft_ms": self.ttft_ms,
            "pdmesh.e2e_ms": timing.e2e_ms,
            "pdmesh.decode.instance_id": result.served_by.decode_instance_id,
            "pdmesh.prefill.instance_id": result.served_by.prefill_instance_id,
        })
