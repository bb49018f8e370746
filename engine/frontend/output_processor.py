"""Turns the core's token deltas into vLLM-shaped `RequestOutput`s: text, stop strings, logprobs.

This is the half of the engine that needs the tokenizer, and it runs outside the core's loop:
in the serving process while the core steps in its own. Per sample it keeps an incremental
detokenizer (which also finds stop strings), the tokens and formatted logprobs so far, and the
finish. A stop string is only ever found here, a little after the core sampled the token, so
`process` returns the samples the core must stop; tokens the core computed past a stop are
dropped here and never reach a client.

With a stream interval N > 1 (vLLM's `--stream-interval`, raised per request by
`SamplingParams.stream_interval`) a running request's output is handed out only once one of its
samples has N tokens not yet handed out; its first output, a sample's finish and the request's
end always go at once. Outputs are cumulative, so nothing is lost in between: the next one
carries every token since the last. Each hop downstream (the service's stream, the router,
the gateway, the client's SSE) then moves one message per N tokens instead of one per token,
which is what the serving processes' CPU is spent on (bench/README.md, "The serving path's
own cost").
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from pdmesh.engine.core_types import CoreOutput, RawLogprob
from pdmesh.engine.frontend.detokenizer import IncrementalDetokenizer
from pdmesh.engine.outputs import (
    CompletionOutput,
    KVExport,
    Logprob,
    RequestOutput,
    TokenLogprobs,
)
from pdmesh.engine.request_rules import check_stream_interval
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.kvstore.connector.source import LoadResult

EXPORTED = "exported"
"""The core's finish for a prefill-role sample: done *here*, a decode instance continues it."""


@dataclass
class _Sample:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    handed_out: int = 0  # tokens in the last output handed out
    finish_handed_out: bool = False


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    export_kv: bool
    stream_interval: int
    samples: dict[int, _Sample] = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    kv_export: KVExport | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    kv_load: LoadResult | None = None

    @property
    def finished(self) -> bool:
        return self.kv_export is not None or (
            len(self.samples) == self.params.n
            and all(s.finish_reason is not None for s in self.samples.values()))

    def due(self) -> bool:
        """Whether an output goes out now: until a token went out (the first token is never
        held), at a finish and at the end, or when a sample has `stream_interval` tokens not
        handed out yet."""
        if self.stream_interval == 1 or self.finished:
            return True
        samples = self.samples.values()
        if not any(s.handed_out for s in samples):
            return True
        return any(
            (s.finish_reason is not None and not s.finish_handed_out)
            or len(s.token_ids) - s.handed_out >= self.stream_interval
            for s in samples)


StopRequest = tuple[str, list[int]]
"""(request id, sample indices) the core must stop: their text hit a stop string."""


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: Collection[int],
                 stream_interval: int = 1) -> None:
        check_stream_interval(stream_interval)
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stream_interval = stream_interval
        self.requests: dict[str, _Request] = {}
        self._pieces: dict[int, str] = {}  # token id -> its text alone (logprob entries)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        export_kv: bool = False,
        given: list[list[int]] | None = None,
        given_logprobs: list[list[TokenLogprobs | None]] | None = None,
    ) -> list[int]:
        """Start tracking a request the core has accepted. `given[i]`: sample i's output
        tokens produced elsewhere (P/D, a resume), with their logprobs if any; they count as
        output. Returns the samples a given token already stopped by stop string."""
        interval = max(self.stream_interval, params.stream_interval or 1)
        req = _Request(request_id, prompt, list(prompt_token_ids), params, export_kv, interval)
        self.requests[request_id] = req
        return self.give(request_id, given, given_logprobs)

    def give(self, request_id: str, given: list[list[int]] | None,
             given_logprobs: list[list[TokenLogprobs | None]] | None = None) -> list[int]:
        """Sample i's output tokens produced elsewhere, `given[i]`, as its first output (at
        `add_request`, or later for a streamed P/D request whose prefill ended after it was
        added); the samples a given token already stopped by stop string."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        stopped: list[int] = []
        for i in range(len(given) if given else 1):
            sample = self._sample(req, i)
            for j, token_id in enumerate(given[i] if given else ()):
                lp = given_logprobs[i][j] if given_logprobs else None
                stop_str = self._append(req, sample, token_id, lp)
                if stop_str is not None:
                    sample.finish_reason, sample.stop_reason = "stop", stop_str
                    stopped.append(i)
                    break
        return stopped

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[StopRequest]]:
        """Apply one batch of core outputs; returns the request outputs to hand out (those
        due, see `_Request.due`) and the samples the core must stop (stop strings)."""
        results: list[RequestOutput] = []
        stops: list[StopRequest] = []
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is None:  # finished here already (stop string) or aborted
                continue
            stopped = self._apply(req, out)
            if stopped:
                stops.append((req.request_id, stopped))
            if req.due():
                results.append(self._make_output(req))
        return results, stops

    # -- internals --------------------------------------------------------------------------------
    def _apply(self, req: _Request, out: CoreOutput) -> list[int]:
        stopped: list[int] = []
        req.num_cached_tokens = out.num_cached_tokens
        if out.ttft_s is not None:
            req.metrics["ttft_s"] = out.ttft_s
        if out.queue_s is not None:
            req.metrics["queue_s"] = out.queue_s
        if out.prompt_logprobs is not None:
            req.prompt_logprobs = [None if r is None else self._entry(r)
                                   for r in out.prompt_logprobs]
        if out.kv_export is not None:
            req.kv_export = KVExport(list(out.kv_export.block_ids), out.kv_export.num_tokens)
        if out.kv_load is not None:
            req.kv_load = out.kv_load
        for delta in out.samples:
            sample = self._sample(req, delta.index)
            if sample.finish_reason is not None:
                continue  # stopped here by a stop string; the core computed a little past it
            last = len(delta.new_token_ids) - 1
            for k, token_id in enumerate(delta.new_token_ids):
                lp = None
                if delta.new_logprobs is not None and k < len(delta.new_logprobs):
                    lp = self._entry(delta.new_logprobs[k])
                stop_str = self._append(req, sample, token_id, lp)
                if stop_str is None:
                    continue
                if k == last and delta.finish_reason == "stop":
                    break  # a stop token on the same token wins, as in check_stop
                sample.finish_reason, sample.stop_reason = "stop", stop_str
                if delta.finish_reason is None:
                    stopped.append(delta.index)
                break
            if sample.finish_reason is None and delta.finish_reason is not None:
                reason = delta.finish_reason
                sample.finish_reason = "length" if reason == EXPORTED else reason
                sample.stop_reason = delta.stop_reason
                if not sample.detokenizer.finished:
                    sample.detokenizer.finish()
        return stopped

    def _sample(self, req: _Request, index: int) -> _Sample:
        sample = req.samples.get(index)
        if sample is None:
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params)
            sample = _Sample(index, detok, logprobs=[] if req.params.logprobs is not None
                             else None)
            req.samples[index] = sample
        return sample

    def _append(self, req: _Request, sample: _Sample, token_id: int,
                logprob: TokenLogprobs | None) -> str | None:
        """Record one output token; the stop string it completed, if any (never for an
        exported request: the decode instance finishes those)."""
        sample.token_ids.append(token_id)
        if sample.logprobs is not None:
            sample.logprobs.append(logprob or {})
            if logprob and token_id in logprob:
                sample.cumulative_logprob += logprob[token_id].logprob
        params = req.params
        is_eos = token_id in self.eos_token_ids and not params.ignore_eos
        if sample.detokenizer.finished:
            return None
        stop_str = sample.detokenizer.update(
            [token_id], stop_terminated=is_eos and len(sample.token_ids) > params.min_tokens)
        return None if req.export_kv else stop_str

    def _entry(self, raw: RawLogprob) -> TokenLogprobs:
        entry = {tid: Logprob(lp, r, self._piece(tid))
                 for r, (tid, lp) in enumerate(zip(raw.top_ids, raw.top_logprobs,
                                                   strict=True), 1)}
        entry[raw.token_id] = Logprob(raw.logprob, raw.rank, self._piece(raw.token_id))
        return entry

    def _piece(self, token_id: int) -> str:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self.tokenizer.decode([token_id])
        return piece

    def _make_output(self, req: _Request) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=s.index,
                text=s.detokenizer.output_text,
                token_ids=list(s.token_ids),
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in sorted(req.samples.values(), key=lambda s: s.index)
        ]
        finished = req.finished
        if finished:
            self.requests.pop(req.request_id, None)
        for sample in req.samples.values():
            sample.handed_out = len(sample.token_ids)
            sample.finish_handed_out = sample.finish_reason is not None
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None
            else None,
            num_cached_tokens=req.num_cached_tokens,
            kv_export=req.kv_export,
            metrics=dict(req.metrics),
            kv_load=req.kv_load,
        )
