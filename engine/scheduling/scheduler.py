"""Iteration-level scheduling: which sequences compute which tokens in the next step.

Each step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`).
Running sequences are served first (decodes and unfinished prompt chunks), then waiting ones
are admitted, with long prompts split into chunks that share the step with decodes. When
blocks run out, the least important running sequence is preempted: its blocks are freed and
it waits to be recomputed (prefix-cache hits usually make that cheap).

A step with decode rows also has a budget in time (engine/scheduling/step_budget.py): its prefill
chunks
take only as many tokens as fit the ITL target beside the decodes, by the step costs the
engine has learned (`step_cost`, fed by the core after every step).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from pdmesh.engine.config import check_long_prefill_threshold
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.scheduling.sequence import Sequence, SequenceStatus
from pdmesh.engine.scheduling.step_budget import ItlTarget, StepBudget
from pdmesh.engine.scheduling.step_cost import StepCostModel

Policy = Literal["fcfs", "priority"]


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: Policy = "fcfs"
    itl_target: ItlTarget = field(default_factory=ItlTarget)
    long_prefill_token_threshold: int = 0  # > 0: the most prompt tokens a sequence takes a step

    def __post_init__(self) -> None:
        check_long_prefill_threshold(self.long_prefill_token_threshold,
                                     self.enable_chunked_prefill)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival) for the priority policy."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._fifo: deque[Sequence] = deque()
        self._heap: list[tuple[int, float, int, Sequence]] = []
        self._counter = itertools.count()

    def add(self, seq: Sequence, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (seq.priority, seq.arrival_time, next(self._counter), seq))
        elif front:
            self._fifo.appendleft(seq)
        else:
            self._fifo.append(seq)

    def peek(self) -> Sequence:
        return self._heap[0][3] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, seq: Sequence) -> bool:
        if self.policy == "priority":
            for i, entry in enumerate(self._heap):
                if entry[3] is seq:
                    self._heap.pop(i)
                    heapq.heapify(self._heap)
                    return True
            return False
        try:
            self._fifo.remove(seq)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __iter__(self) -> Iterator[Sequence]:
        if self.policy == "priority":
            return (e[3] for e in sorted(self._heap))
        return iter(self._fifo)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        max_model_len: int,
        step_cost: StepCostModel | None = None,
    ) -> None:
        """`step_cost`: the engine's step-cost model (its attention weight is the model's);
        a bare one when not given."""
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={config.max_num_batched_tokens} must be >= "
                f"max_model_len={max_model_len} when chunked prefill is disabled"
            )
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.step_cost = step_cost or StepCostModel()
        self.itl_target_s = 0.0  # the target of the last step bounded in time (metrics)
        # Called with every sequence the scheduler preempts (the engine resets its state).
        self.on_preempt: Callable[[Sequence], None] | None = None

    # -- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.add(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already owns its blocks (a fork, or imported KV)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus, free_blocks: bool = True) -> None:
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        if free_blocks:
            self.kv.free(seq.seq_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- the step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        if self.config.policy == "priority":
            # Serve the most important first, so blocks running short preempt the least important.
            self.running.sort(key=lambda s: (s.priority, s.arrival_time))
            self._make_room_for_waiting(out)

        # 1) Running sequences first: decodes and the rest of chunked prompts.
        num_room_made = len(out.preempted)
        step = self._time_budget()
        if step.bounded:
            self.itl_target_s = step.seconds
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new > 1:
                num_new = step.take_prefill(seq.num_computed_tokens, self._chunk(num_new))
            if num_new <= 0 or seq.pending_reaches_length(self.max_model_len):
                i += 1
                continue
            while not self.kv.allocate_slots(seq, num_new):
                victim = self._pick_victim(exclude=scheduled_ids)
                if victim is None or victim is seq:
                    # Nothing else to preempt: this one waits for blocks.
                    if victim is seq:
                        self._preempt(seq, out)
                    seq = None
                    break
                self._preempt(victim, out)
            if seq is None:
                continue  # the running list shrank; index i now holds the next sequence
            out.scheduled.append(ScheduledSeq(seq, num_new))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new
            i += 1

        # 2) Admit waiting sequences while budget, sequence slots and blocks last. A step whose
        #    running sequences ran out of blocks admits nothing new, so sequences do not bounce.
        ran_out = len(out.preempted) > num_room_made
        while (
            not ran_out
            and len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting.peek()
            if seq.num_pending:  # preempted with a token in flight: admitted once it lands
                break
            cached = self.kv.find_cached_prefix(seq) if seq.num_computed_tokens == 0 else []
            num_cached_tokens = len(cached) * self.kv.block_size
            remaining = seq.num_tokens - seq.num_computed_tokens - num_cached_tokens
            if remaining > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(remaining, budget)
            if self.config.enable_chunked_prefill:
                num_new = step.take_prefill(seq.num_computed_tokens + num_cached_tokens,
                                            self._chunk(num_new))
            if num_new <= 0 or not self.kv.allocate_slots(seq, num_new, cached):
                break
            self.waiting.pop()
            if not seq.scheduled_once:
                seq.scheduled_once = True
                seq.num_cached_tokens = num_cached_tokens
                self.kv.record_prefix_query(seq.num_prompt_tokens, num_cached_tokens)
            seq.num_computed_tokens += num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new
        return out

    def _chunk(self, num_new: int) -> int:
        """A prompt's tokens this step under vLLM's long_prefill_token_threshold: a long
        prompt goes in chunks of at most that many, so it shares steps with other prompts."""
        cap = self.config.long_prefill_token_threshold
        return min(num_new, cap) if cap > 0 else num_new

    def _time_budget(self) -> StepBudget:
        """This step's budget in time: its decode rows (one token each) counted first."""
        if not self.config.enable_chunked_prefill:
            return StepBudget.unbounded()
        decodes = [(seq.num_computed_tokens, 1) for seq in self.running
                   if seq.num_uncomputed_tokens == 1
                   and not seq.pending_reaches_length(self.max_model_len)]
        return StepBudget.for_step(self.config.itl_target, self.step_cost, decodes)

    def _pick_victim(self, exclude: set[str]) -> Sequence | None:
        """The running sequence to give up: the newest (FCFS) or the least important."""
        candidates = [s for s in self.running if s.seq_id not in exclude]
        if not candidates:
            return None
        if self.config.policy == "priority":
            return max(candidates, key=lambda s: (s.priority, s.arrival_time))
        return candidates[-1]

    def _make_room_for_waiting(self, out: SchedulerOutput) -> None:
        """Priority policy: a more important waiting sequence evicts less important running ones.

        Runs before anything is scheduled in the step, so no sequence is un-scheduled after its
        blocks were allocated (and registered in the prefix cache).
        """
        if not len(self.waiting):
            return
        head = self.waiting.peek()
        needed = self.kv.num_blocks_for(head.num_tokens) - len(self.kv.find_cached_prefix(head))
        while self.running and self.kv.num_free_blocks < needed:
            victim = max(self.running, key=lambda s: (s.priority, s.arrival_time))
            if (victim.priority, victim.arrival_time) <= (head.priority, head.arrival_time):
                return
            self._preempt(victim, out)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        if self.on_preempt is not None:
            self.on_preempt(seq)
        self.waiting.add(seq, front=True)
        seq.status = SequenceStatus.WAITING
