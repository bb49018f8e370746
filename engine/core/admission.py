"""Placing a checked `EngineRequest`'s samples in the scheduler, whatever it brings.

One path for every request (engine/engine_request.py), in two moves:

1. *make the samples*: a prompt alone becomes one parent sequence that forks into `n` after its
   first token (`fork_into`), or exports then; imported KV is written into fresh blocks of
   a running parent, whose forks are made at once (no room for the prompt right now: the
   parent waits like a preempted sequence and recomputes it); given tokens alone make one
   waiting sequence per sample, each to prefill prompt + its tokens (prefix-cache hits make
   the shared prompt cheap);
2. *replay the given tokens*: a seeded sample's generator skips one draw per token (sampler
   `skip_one_draw`), then each token is committed as if sampled here: its grammar accepts it
   (or the request is refused), stop checks see it, and it counts as output. A sample they
   end is finished at once and never continued.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from pdmesh.engine.core.output_commit import OutputCommit
from pdmesh.engine.core.request_state import CoreRequest, SampleMaker
from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.scheduling.scheduler import Scheduler
from pdmesh.engine.scheduling.sequence import Sequence, SequenceStatus
from pdmesh.engine.worker.sampler import skip_one_draw
from pdmesh.kvstore.connector.connector import KVConnector
from pdmesh.kvstore.connector.source import LoadResult
from pdmesh.kvstore.transfer.errors import KVTransferError, failure_outcome

logger = logging.getLogger(__name__)


@dataclass
class Loading:
    """A prompt whose KV a connector thread is pulling into `parent`'s fresh blocks."""

    state: CoreRequest
    parent: Sequence
    request: EngineRequest
    future: Future[int]
    reused: int
    pulled: int
    started: float
    abandoned: bool = False


class Admission:
    def __init__(self, scheduler: Scheduler, kv_manager: KVCacheManager, kv_cache: torch.Tensor,
                 samples: SampleMaker, commit: OutputCommit, vocab_size: int,
                 connector: KVConnector | None = None) -> None:
        self.scheduler = scheduler
        self.connector = connector
        self.loading: dict[str, Loading] = {}  # pulls in flight, by request id
        self.kv_manager = kv_manager
        self.kv_cache = kv_cache
        self.samples = samples
        self.commit = commit
        self.vocab_size = vocab_size

    def place(self, state: CoreRequest, request: EngineRequest) -> None:
        """Make `state`'s samples and queue them. On an error the caller aborts the request,
        which frees whatever it holds by then. A prompt whose KV a connector thread now pulls
        gets its samples when the pull lands (`land_loads`)."""
        given = request.given_tokens
        if request.kv is not None or request.kv_source is not None:
            if self._import(state, request):
                return
        elif given is not None:
            for i in range(request.params.n):
                seq = self._new(request, i)
                state.seqs.append(seq)
                self.scheduler.add(seq)
            if any(given):
                state.first_token_time = time.monotonic()
        else:
            self._queue_prompt(state, request)
            return
        for seq, tokens in zip(list(state.seqs), given or [], strict=True):
            self._replay(seq, tokens)

    def _new(self, request: EngineRequest, index: int) -> Sequence:
        ids = request.prompt_token_ids
        return self.samples.new(request.request_id, index, list(ids), len(ids), request.params,
                                request.priority, request.cache_salt)

    def _queue_prompt(self, state: CoreRequest, request: EngineRequest) -> None:
        """A fresh prompt: one parent; with `export_kv` it stops after its first token."""
        params = request.params
        seq = self._new(request, 0)
        seq.fork_into = params.n
        seq.export_kv = request.export_kv
        seq.want_prompt_logprobs = params.prompt_logprobs is not None
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        state.seqs.append(seq)
        self.scheduler.add(seq)

    def _import(self, state: CoreRequest, request: EngineRequest) -> bool:
        """The prompt's KV computed elsewhere: a running parent holding it, and its forks.

        A `kv_source` is pulled by this core's connector on its own threads, only the blocks
        after this core's prefix-cache hits (True: the parent waits in `loading` until the
        pull lands). A tensor `kv` (a staged transport) is copied in whole now. No room right
        now, or a pull that fails: the parent waits like a preempted sequence and recomputes
        the prompt here, instead of failing a request that fits the pool.
        """
        parent = self._new(request, 0)
        parent.num_cached_tokens = request.num_cached_tokens
        parent.scheduled_once = True  # the prefill instance computed (and counted) the prompt
        state.first_token_time = state.first_scheduled_time = time.monotonic()
        state.seqs.append(parent)
        num_prompt = len(request.prompt_token_ids)
        if request.kv_source is not None:
            if self._start_pull(state, parent, request):
                return True
            loaded = False
        elif self.kv_manager.allocate_slots(parent, num_prompt):
            assert request.kv is not None
            block_ids = torch.tensor(self.kv_manager.block_ids(parent.seq_id),
                                     device=self.kv_cache.device)
            self.kv_cache.index_copy_(2, block_ids, request.kv.to(self.kv_cache.device,
                                                                   self.kv_cache.dtype))
            loaded = True
        else:
            loaded = False
        self._place_parent(state, request, parent, loaded)
        return False

    def _place_parent(self, state: CoreRequest, request: EngineRequest, parent: Sequence,
                      loaded: bool) -> None:
        if loaded:
            parent.num_computed_tokens = len(request.prompt_token_ids)
            self.scheduler.add_running(parent)
        else:
            logger.debug("request_id=%s: imported KV not placed; it recomputes",
                         request.request_id)
            self.scheduler.add(parent)
        for i in range(1, request.params.n):
            state.seqs.append(self.samples.fork_or_queue(parent, i))

    def _start_pull(self, state: CoreRequest, parent: Sequence, request: EngineRequest) -> bool:
        """Our own prefix hits for the leading blocks, the rest pulled through the connector
        into fresh blocks that become findable by hash only once their KV checks out."""
        assert self.connector is not None and request.kv_source is not None
        started = time.monotonic()
        hits = self.kv_manager.find_cached_prefix(parent)
        num_prompt = len(request.prompt_token_ids)
        block_size = self.kv_manager.block_size
        if not self.kv_manager.allocate_slots(parent, num_prompt - len(hits) * block_size,
                                              hits, cache=False):
            state.kv_load = LoadResult(reused_blocks=len(hits), reason="no_free_blocks",
                                       error="no free KV blocks for the prompt right now")
            return False
        dst = self.kv_manager.block_ids(parent.seq_id)[len(hits):]
        future = self.connector.start_load(request.kv_source, len(hits), dst)
        self.loading[request.request_id] = Loading(state, parent, request, future, len(hits),
                                                   len(dst), started)
        return True

    def abandon(self, request_id: str) -> bool:
        """The request was aborted while its KV is pulled: its blocks go back once the pull
        has stopped writing into them (`land_loads`). False if it is not loading."""
        loading = self.loading.get(request_id)
        if loading is None:
            return False
        loading.abandoned = True
        return True

    def land_loads(self) -> list[str]:
        """Place the requests whose pull finished (between two steps): on success the parent
        runs with the pulled blocks, now cached; on failure the blocks go back clean and the
        prompt is recomputed. The ids of the requests placed (they owe an output)."""
        placed = []
        for request_id, loading in list(self.loading.items()):
            if not loading.future.done():
                continue
            del self.loading[request_id]
            parent, request = loading.parent, loading.request
            error = loading.future.exception()
            if loading.abandoned:
                self.kv_manager.free(parent.seq_id)
                continue
            seconds = time.monotonic() - loading.started
            if error is None:
                self.kv_manager.cache_full_blocks(parent, len(request.prompt_token_ids))
                loading.state.kv_load = LoadResult(loading.reused, loading.pulled,
                                                   loading.future.result(), seconds)
            else:
                self.kv_manager.free(parent.seq_id)  # never cached: the blocks go back clean
                loading.state.kv_load = LoadResult(
                    reused_blocks=loading.reused, error=f"{type(error).__name__}: {error}",
                    reason=_failure_reason(error), seconds=seconds)
            self._place_parent(loading.state, request, parent, error is None)
            try:
                for seq, tokens in zip(list(loading.state.seqs), request.given_tokens or [],
                                       strict=True):
                    self._replay(seq, tokens)
            except ValueError as exc:  # cannot happen for the prefill's own first tokens
                logger.warning("request_id=%s: its given tokens were refused after its KV "
                               "landed: %s", request_id, exc)
                for seq in loading.state.seqs:
                    if not seq.status.is_finished:
                        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            placed.append(request_id)
        return placed

    def _replay(self, seq: Sequence, given: list[int]) -> None:
        """Commit tokens produced elsewhere as this sample's output (not reported back)."""
        if seq.generator is not None and not seq.params.is_greedy:
            for _ in given:
                skip_one_draw(seq.generator, self.vocab_size)
        for j, token_id in enumerate(given):
            if seq.status.is_finished:
                raise ValueError(f"given_tokens: sample {seq.index} goes on after it stopped "
                                 f"at position {j - 1}")
            self.commit.append_token(seq, int(token_id), None, replay=True)
        seq.num_emitted = seq.num_output_tokens


def _failure_reason(exc: BaseException) -> str:
    """The label a failed pull is counted under (the transfer layer's vocabulary)."""
    return failure_outcome(exc) if isinstance(exc, KVTransferError) else "invalid_source"
