"""A request inside the core: its samples, and how each sample's sequence comes to be.

A request runs as one `Sequence` per sample. An n > 1 request starts as one parent (its prompt
is computed once) and forks after the parent's first token: a fork shares the parent's blocks,
its partial last block copied on write (`KVCacheManager.fork`); a fork that finds no block
right now waits in the scheduler and recomputes the prompt, mostly from the prefix cache, so a
request that fits the pool never fails for want of blocks at the moment. Sample i's seeded
generator starts from `child_seed(seed, i)`: samples differ, and each replays exactly.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdmesh.engine.core_types import KVExportInfo, RawLogprob
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.scheduling.scheduler import Scheduler
from pdmesh.engine.scheduling.sequence import Sequence
from pdmesh.engine.worker.sampler import child_seed, make_generator
from pdmesh.kvstore.connector.source import LoadResult

if TYPE_CHECKING:
    from pdmesh.engine.structured.grammar import GrammarMatcher
    from pdmesh.engine.structured_output import StructuredOutput


@dataclass
class CoreRequest:
    """The core's view of one request: its samples and what it has reported so far."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    prompt_logprobs: list[RawLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    export_kv: bool = False
    kv_export: KVExportInfo | None = None
    kv_load: LoadResult | None = None  # a pull of the prompt's KV by this core's connector
    kv_load_sent: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    timing_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs) and len(self.seqs) == self.params.n


GrammarMatchers = Callable[["StructuredOutput"], "GrammarMatcher"]
BlockCopier = Callable[[list[tuple[int, int]]], None]


class SampleMaker:
    """Makes the sequences of a request's samples: new ones, siblings and forks."""

    def __init__(self, scheduler: Scheduler, kv_manager: KVCacheManager,
                 copy_blocks: BlockCopier, grammar_matcher: GrammarMatchers,
                 device: torch.device) -> None:
        self.scheduler = scheduler
        self.kv_manager = kv_manager
        self.copy_blocks = copy_blocks
        self.grammar_matcher = grammar_matcher
        self.device = device
        self._serial = itertools.count()

    def new(self, request_id: str, index: int, token_ids: list[int], num_prompt: int,
            params: SamplingParams, priority: int = 0, cache_salt: str | None = None,
            ) -> Sequence:
        """Sample `index`: its own generator, logprob list and grammar matcher."""
        seq = Sequence(
            # Unique in the core: a colocated instance decodes an id whose export it still
            # lends (KVExports.lent), and blocks are kept by sequence id.
            seq_id=f"{request_id}#{index}#{next(self._serial)}",
            request_id=request_id,
            index=index,
            token_ids=token_ids,
            num_prompt_tokens=num_prompt,
            params=params,
            priority=priority,
            cache_salt=cache_salt,
            generator=make_generator(child_seed(params.seed, index), self.device),
        )
        if params.logprobs is not None:
            seq.logprobs = []
        if params.structured_output is not None:
            seq.grammar = self.grammar_matcher(params.structured_output)
        return seq

    def sibling(self, parent: Sequence, index: int) -> Sequence:
        """Sample `index` of the parent's request: its tokens so far, its own generator."""
        return self.new(parent.request_id, index, list(parent.token_ids),
                        parent.num_prompt_tokens, parent.params, parent.priority,
                        parent.cache_salt)

    def fork_or_queue(self, parent: Sequence, index: int) -> Sequence:
        """Sample `index`: a running fork sharing the parent's blocks, or, when there is no
        room for it right now (or the parent holds no blocks yet), a sibling that waits in the
        scheduler. Never fails for lack of blocks."""
        child = self._fork(parent, index)
        if child is None:
            child = self.sibling(parent, index)
            child.arrival_time = parent.arrival_time  # queued as part of its request
            self.scheduler.add(child)
        return child

    def _fork(self, parent: Sequence, index: int) -> Sequence | None:
        """A running copy of `parent` sharing its blocks; None without room or parent blocks."""
        if not self.kv_manager.has_blocks(parent.seq_id):
            return None
        child = self.sibling(parent, index)
        try:
            copy = self.kv_manager.fork(parent, child)
        except RuntimeError:
            return None
        if copy is not None:
            self.copy_blocks([copy])
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.scheduled_once = True
        self.scheduler.add_running(child)
        return child
