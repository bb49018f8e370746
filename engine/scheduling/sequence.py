"""The schedulable unit: one output sequence of a request, and its lifecycle states.

A request with `n > 1` starts as one sequence; once the prompt is computed it forks into `n`
sequences that share the prompt's KV blocks. Prefill and decode are not separate phases
here: a sequence always has `num_computed_tokens <= len(token_ids)`, and each step computes
the next slice (a prompt chunk, a recompute after preemption, or one decode token).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pdmesh.engine.core_types import RawLogprob
    from pdmesh.engine.sampling_params import SamplingParams
    from pdmesh.engine.structured.grammar import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_EXPORTED = "exported"  # prefill role: done here, KV pinned for a decode instance

    @property
    def is_finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    generator: torch.Generator | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    stop_reason: int | None = None  # the stop token id that ended it (strings: not here)
    logprobs: list[RawLogprob] | None = None  # of output tokens not reported yet
    num_emitted: int = 0  # output tokens reported (or given by the caller)
    finish_emitted: bool = False
    # Set on the parent of an n > 1 request until it samples and forks.
    fork_into: int = 1
    export_kv: bool = False
    want_prompt_logprobs: bool = False  # until every prompt position's logprobs are recorded
    scheduled_once: bool = False
    grammar: GrammarMatcher | None = None  # structured output: where this sample is in it
    # Async scheduling: tokens sampled by a step still in flight, not yet in `token_ids`.
    # They count as uncomputed (the next step computes them, its input read on the device).
    num_pending: int = 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    def pending_reaches_length(self, max_model_len: int) -> bool:
        """Its in-flight token is its last one by length (max_tokens or the context): no
        step need compute past it."""
        if not self.num_pending:
            return False
        total = len(self.token_ids) + self.num_pending
        max_tokens = self.params.max_tokens
        return total >= max_model_len or (
            max_tokens is not None and total - self.num_prompt_tokens >= max_tokens)

    @property
    def is_prefilling(self) -> bool:
        """Still computing prompt tokens (no logits needed unless prompt logprobs are)."""
        return self.num_computed_tokens < self.num_prompt_tokens
