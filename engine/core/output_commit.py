"""Committing a step: tokens into their sequences, stops, forks, exports, and the deltas out.

`update_from_output` is the one place where what the model computed changes the requests
(vLLM's `Scheduler.update_from_output`, nano-vllm's `postprocess`). In order:

1. the step's progress: computed tokens, prompt logprobs, when each request was first run;
2. the previous step's tokens, if it was left in flight (async scheduling,
engine/worker/in_flight.py):
   they come before this step's, and a sequence they end discards what this step sampled;
3. this step's samples: an exporting sequence (prefill role) records its first token(s) and
   pins its prompt's blocks; the parent of an n > 1 request forks into its samples; every
   other sequence appends its token. Each token is checked against the stop rule
   (engine/core/stopping.py) and the sample's grammar;
4. one `CoreOutput` delta per request touched: the new tokens of each sample since the last.

`append_token` is also how given tokens are replayed when a request is added (P/D first
tokens, a resume): the same stop checks, and a token its grammar forbids is bad input.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

from pdmesh.engine.core.request_state import CoreRequest, SampleMaker
from pdmesh.engine.core.stopping import check_stop
from pdmesh.engine.core_types import CoreOutput, KVExportInfo, RawLogprob, SampleDelta
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.scheduling.scheduler import Scheduler
from pdmesh.engine.scheduling.sequence import Sequence, SequenceStatus
from pdmesh.engine.worker.in_flight import InFlightStep
from pdmesh.engine.worker.model_runner import ModelOutput
from pdmesh.engine.worker.step_sampling import Sample

logger = logging.getLogger(__name__)


class OutputCommit:
    def __init__(self, requests: dict[str, CoreRequest], scheduler: Scheduler,
                 kv_manager: KVCacheManager, samples: SampleMaker,
                 eos_token_ids: Collection[int], max_model_len: int) -> None:
        self.requests = requests  # the core's own dict: finished requests leave it here
        self.scheduler = scheduler
        self.kv_manager = kv_manager
        self.samples = samples
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def update_from_output(
        self,
        touched: dict[str, CoreRequest],
        output: ModelOutput | None = None,
        previous: InFlightStep | None = None,
        scheduled_at: float = 0.0,
    ) -> list[CoreOutput]:
        """Commit a step's `output` (run at `scheduled_at`) and the `previous` step still in
        flight; the deltas of `touched` (the requests commands changed since the last step)
        and of every request the steps changed."""
        if output is not None:
            self._advance(output, touched, scheduled_at)
        if previous is not None:  # its tokens come before this step's
            self._land(previous, touched)
        if output is not None:
            self._commit_samples(output.sampled)
        return [self._make_output(state) for state in touched.values()]

    def _advance(self, output: ModelOutput, touched: dict[str, CoreRequest],
                 scheduled_at: float) -> None:
        for entry in output.order:
            seq = entry.seq
            state = self.requests[seq.request_id]
            touched[state.request_id] = state
            if state.first_scheduled_time is None:
                state.first_scheduled_time = scheduled_at
            logprobs = output.prompt_logprobs.get(seq.seq_id)
            if logprobs is not None:
                assert state.prompt_logprobs is not None
                state.prompt_logprobs.extend(logprobs)
            seq.num_computed_tokens += entry.num_new_tokens
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                seq.want_prompt_logprobs = False

    def _land(self, step: InFlightStep, touched: dict[str, CoreRequest]) -> None:
        """Record a launched step's tokens; sequences that ended meanwhile (aborted, stopped
        by a stop string, or by their token of the step before) discard theirs."""
        now = time.monotonic()
        for seq, token_id in step.land():
            state = self.requests.get(seq.request_id)
            if state is None or seq.status.is_finished:
                continue
            touched[state.request_id] = state
            if state.first_token_time is None:
                state.first_token_time = now
            self.append_token(seq, token_id, None)

    def _commit_samples(self, sampled: list[tuple[Sequence, list[Sample]]]) -> None:
        now = time.monotonic()
        for seq, samples in sampled:
            if seq.status.is_finished:  # ended by the token of the step before, just landed
                continue
            state = self.requests[seq.request_id]
            if state.first_token_time is None:
                state.first_token_time = now
            if seq.export_kv and seq.num_output_tokens == 0:
                seq.fork_into = 1
                self._export(state, seq, samples)
            elif len(samples) > 1:
                self._fan_out(state, seq, samples)
            else:
                self._take(seq, samples[0])

    def _take(self, seq: Sequence, sample: Sample) -> None:
        """`sample`'s token into `seq`, or, at a dead end (its masks left no token), the end of
        `seq` with what it has: finish reason "stop", no token appended. vLLM samples from an
        all -inf row here (token 0, or NaN probabilities); a client would see a token its own
        constraints forbid."""
        if not sample.dead_end:
            self.append_token(seq, sample.token_id, sample.logprob)
            return
        logger.warning("request_id=%s: sample %d has no token its masks allow "
                       "(allowed_token_ids, grammar, bad_words, min_tokens); stopped",
                       seq.request_id, seq.index)
        self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)

    def _fan_out(self, state: CoreRequest, parent: Sequence, samples: list[Sample]) -> None:
        """The prompt of an n > 1 request is done: one first token per sample, then fork."""
        parent.fork_into = 1
        state.seqs = [parent]
        for i in range(1, len(samples)):
            child = self.samples.fork_or_queue(parent, i)
            child.generator = samples[i].generator
            state.seqs.append(child)
        for seq, sample in zip(list(state.seqs), samples, strict=True):
            self._take(seq, sample)

    def _export(self, state: CoreRequest, seq: Sequence, samples: list[Sample]) -> None:
        """Prefill role: record the first token(s), keep the prompt's blocks pinned. A
        sample at a dead end records none: the prefill service reports it finished
        (prefill_svc/servicer.py `response`) and no decode instance continues it."""
        for i, sample in enumerate(samples):
            target = seq
            if i > 0:
                target = self.samples.sibling(seq, i)
                target.token_ids = list(seq.prompt_token_ids)  # not sample 0's first token
                target.status = SequenceStatus.FINISHED_EXPORTED
                state.seqs.append(target)
            if not sample.dead_end:
                self.append_token(target, sample.token_id, sample.logprob, export=True)
        state.kv_export = KVExportInfo(self.kv_manager.block_ids(seq.seq_id),
                                       seq.num_prompt_tokens)
        self.scheduler.finish(seq, SequenceStatus.FINISHED_EXPORTED, free_blocks=False)

    def append_token(self, seq: Sequence, token_id: int, logprob: RawLogprob | None,
                     export: bool = False, replay: bool = False) -> None:
        """Record one output token. `replay`: it was produced elsewhere (P/D, a resume), so a
        token its grammar forbids is bad input (ValueError) rather than a finished sample."""
        grammar_ok = seq.grammar is None or seq.grammar.accept(token_id)
        if not grammar_ok and replay:
            raise ValueError(f"given_tokens: token {token_id} of sample {seq.index} does not "
                             "follow the request's structured_output grammar")
        seq.token_ids.append(token_id)
        if seq.logprobs is not None and logprob is not None:
            seq.logprobs.append(logprob)
        if export:
            return
        status = self._check_stop(seq, token_id)
        if status is None and seq.grammar is not None and (
                not grammar_ok or seq.grammar.is_terminated):
            if not grammar_ok:  # not expected: the pick obeys the bitmask (a row it left
                # no token is a dead end, `_take`); a matcher disagreeing with its own
                # bitmask still ends the sample rather than its request
                logger.warning("request_id=%s: sample %d left its grammar; stopped",
                               seq.request_id, seq.index)
            status = SequenceStatus.FINISHED_STOPPED
        if status is not None:
            self.scheduler.finish(seq, status)

    def _check_stop(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        finish = check_stop(
            token_id, num_output_tokens=seq.num_output_tokens, num_tokens=seq.num_tokens,
            params=seq.params, eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
        )
        if finish is None:
            return None
        reason, stop_reason = finish
        if isinstance(stop_reason, int):
            seq.stop_reason = stop_reason
        return (SequenceStatus.FINISHED_STOPPED if reason == "stop"
                else SequenceStatus.FINISHED_LENGTH)

    def on_preempt(self, seq: Sequence) -> None:
        """A preempted prompt is recomputed from its start: so are its prompt logprobs."""
        state = self.requests.get(seq.request_id)
        if state is not None and seq.want_prompt_logprobs:
            state.prompt_logprobs = [None]  # recomputed from the first prompt token

    def _make_output(self, state: CoreRequest) -> CoreOutput:
        """What changed in `state` since its last output; a finished request leaves the core
        (an exported one stays, pinned, until its KV is released)."""
        samples: list[SampleDelta] = []
        for seq in state.seqs:
            new = seq.token_ids[seq.num_prompt_tokens + seq.num_emitted:]
            finish = None
            if seq.status.is_finished and not seq.finish_emitted:
                finish = seq.status.value
                seq.finish_emitted = True
            if not new and finish is None:
                continue
            seq.num_emitted += len(new)
            lps = None
            if seq.logprobs is not None:
                lps, seq.logprobs = seq.logprobs, []
            samples.append(SampleDelta(seq.index, new, lps, finish,
                                       seq.stop_reason if finish == "stop" else None))
        out = CoreOutput(state.request_id, samples,
                         num_cached_tokens=state.seqs[0].num_cached_tokens if state.seqs else 0)
        if (state.prompt_logprobs is not None and not state.prompt_logprobs_sent
                and len(state.prompt_logprobs) >= len(state.prompt_token_ids)):
            out.prompt_logprobs = state.prompt_logprobs
            state.prompt_logprobs_sent = True
        if state.kv_load is not None and not state.kv_load_sent:
            out.kv_load, state.kv_load_sent = state.kv_load, True
        if state.kv_export is not None:
            out.kv_export = state.kv_export
            out.finished = True
        elif state.finished:
            self.requests.pop(state.request_id, None)
            out.finished = True
        if state.first_token_time is not None and not state.timing_sent:
            state.timing_sent = True
            out.ttft_s = state.first_token_time - state.arrival_time
            if state.first_scheduled_time is not None:
                out.queue_s = max(0.0, state.first_scheduled_time - state.arrival_time)
        return out
