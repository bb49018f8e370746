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

A *lent prefix* (`EngineRequest.prefix_source`: a peer holds the prompt's leading blocks) is
pulled the same way before the prompt is queued: the blocks our prefix cache lacks land in
fresh blocks, are cached once they check out, and the prompt then queues like any other, its
prefix a cache hit; a pull that fails leaves the prompt to be computed whole.

A *streamed* source (`KVSource.streamed`: the prefill is still computing the prompt) is pulled
batch by batch: the blocks arrive as the sender's progress (`stream_progress`), each batch of
newly ready blocks this core lacks is pulled on the connector's threads while the core keeps
stepping, and the request is placed once the export is sealed, every block has landed and
checked, and its first tokens came (`stream_first_tokens`). A stream that fails (the sender's
export failed, a batch failed its checks or deadline) frees its blocks at once and, when the
first tokens come, recomputes the prompt here like any failed pull. The stream's own
bookkeeping (progress taken, batches, failure) is engine/core/pull_streams.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from pdmesh.engine.core.output_commit import OutputCommit
from pdmesh.engine.core.pull_streams import PullStream, failure_reason
from pdmesh.engine.core.request_state import CoreRequest, SampleMaker
from pdmesh.engine.engine_request import EngineRequest, check_given_tokens
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.scheduling.scheduler import Scheduler
from pdmesh.engine.scheduling.sequence import Sequence, SequenceStatus
from pdmesh.engine.worker.models.llama import ModelConfig
from pdmesh.engine.worker.sampler import skip_one_draw
from pdmesh.kvstore.connector.connector import KVConnector
from pdmesh.kvstore.connector.export_info import ExportProgress
from pdmesh.kvstore.connector.source import LoadResult

logger = logging.getLogger(__name__)


@dataclass
class Loading:
    """A prompt whose KV a connector thread is pulling into `parent`'s fresh blocks."""

    state: CoreRequest
    parent: Sequence
    request: EngineRequest
    future: Future[int] | None  # a stream waiting for its next blocks: None
    reused: int
    pulled: int
    started: float
    abandoned: bool = False
    stream: PullStream | None = None
    prefix: bool = False  # a peer's lent prefix: the prompt is computed after it lands


def check_kv_import(request: EngineRequest, mc: ModelConfig, kv_manager: KVCacheManager,
                    block_size: int, connector: KVConnector | None) -> None:
    """ValueError for imported KV this core cannot take: a tensor `kv` not shaped like the
    prompt's blocks of this model, a `kv_source` without a connector or not covering the
    prompt (the source's own checks are the connector's)."""
    if request.kv is not None:
        nb = kv_manager.num_blocks_for(len(request.prompt_token_ids))
        expected = (mc.num_layers, 2, nb, block_size, mc.num_kv_heads, mc.head_dim)
        if tuple(request.kv.shape) != expected:
            raise ValueError(f"kv: shape {tuple(request.kv.shape)} does not match {expected}")
    if request.prefix_source is not None:
        if connector is None:
            raise ValueError("prefix_source: this engine has no KV connector")
        connector.check_source(request.prefix_source)
        if request.prefix_source.num_tokens % block_size:
            raise ValueError("prefix_source: a lent prefix covers whole blocks only")
    if request.kv_source is not None:
        if connector is None:
            raise ValueError("kv_source: this engine has no KV connector")
        connector.check_source(request.kv_source)
        if request.kv_source.num_tokens != len(request.prompt_token_ids):
            raise ValueError(f"kv_source: covers {request.kv_source.num_tokens} tokens, "
                             f"the prompt has {len(request.prompt_token_ids)}")


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
            seq = self._prompt_parent(state, request)
            if request.prefix_source is None or not self._start_prefix_pull(state, seq,
                                                                             request):
                self.scheduler.add(seq)
            return
        for seq, tokens in zip(list(state.seqs), given or [], strict=True):
            self._replay(seq, tokens)

    def _new(self, request: EngineRequest, index: int) -> Sequence:
        ids = request.prompt_token_ids
        return self.samples.new(request.request_id, index, list(ids), len(ids), request.params,
                                request.priority, request.cache_salt)

    def _prompt_parent(self, state: CoreRequest, request: EngineRequest) -> Sequence:
        """A fresh prompt's one parent (to queue); with `export_kv` it stops after its first
        token."""
        params = request.params
        seq = self._new(request, 0)
        seq.fork_into = params.n
        seq.export_kv = request.export_kv
        seq.want_prompt_logprobs = params.prompt_logprobs is not None
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        state.seqs.append(seq)
        return seq

    def _start_prefix_pull(self, state: CoreRequest, parent: Sequence,
                           request: EngineRequest) -> bool:
        """A peer lends the prompt's leading blocks: those our prefix cache lacks are pulled
        into fresh blocks (True: the parent waits in `loading`), cached once they check out,
        and the prompt is then queued as usual, its prefix now a cache hit. False: nothing
        to pull, or no room for it now (the prompt is queued and computed here)."""
        assert self.connector is not None and request.prefix_source is not None
        started = time.monotonic()
        source = request.prefix_source
        block_size = self.kv_manager.block_size
        num_source = source.num_tokens // block_size
        hits = self.kv_manager.find_cached_prefix(parent)[:num_source]
        if len(hits) >= num_source:
            state.kv_load = LoadResult(reused_blocks=len(hits))
            return False
        if not self.kv_manager.allocate_slots(parent, (num_source - len(hits)) * block_size,
                                              hits, cache=False):
            state.kv_load = LoadResult(reused_blocks=len(hits), reason="no_free_blocks",
                                       error="no free KV blocks for the lent prefix right now")
            self.kv_manager.free(parent.seq_id)
            return False
        dst = self.kv_manager.block_ids(parent.seq_id)[len(hits):]
        future = self.connector.start_load(source, len(hits), dst)
        self.loading[request.request_id] = Loading(state, parent, request, future, len(hits),
                                                   len(dst), started, prefix=True)
        return True

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
            if request.kv_source.streamed:  # it still waits for its first tokens
                stream = PullStream(request.kv_source, [], 0, error=state.kv_load.error,
                                    reason=state.kv_load.reason, blocks_freed=True)
                self.loading[request.request_id] = Loading(state, parent, request, None, 0, 0,
                                                           started, stream=stream)
                return True
            return False
        dst = self.kv_manager.block_ids(parent.seq_id)[len(hits):]
        if request.kv_source.streamed:
            stream = PullStream.opened(request.kv_source,
                                       self.kv_manager.block_ids(parent.seq_id), len(hits))
            self.loading[request.request_id] = Loading(state, parent, request, None, len(hits),
                                                       len(dst), started, stream=stream)
            return True
        future = self.connector.start_load(request.kv_source, len(hits), dst)
        self.loading[request.request_id] = Loading(state, parent, request, future, len(hits),
                                                   len(dst), started)
        return True

    # -- streamed pulls ----------------------------------------------------------------------
    def stream_progress(self, request_id: str, progress: ExportProgress) -> bool:
        """The sender's export grew (or sealed, or failed); False if no streamed pull of
        `request_id` is waiting for it (aborted, or already failed and placed)."""
        loading = self.loading.get(request_id)
        if loading is None or loading.stream is None or loading.abandoned:
            return False
        loading.stream.take_progress(progress)
        return True

    def stream_first_tokens(self, request_id: str, given_tokens: list[list[int]],
                            max_model_len: int) -> bool:
        """The prefill's first token of each sample (its last message): the request may be
        placed once its KV has landed. ValueError for tokens it can never take."""
        loading = self.loading.get(request_id)
        if loading is None or loading.stream is None or loading.abandoned:
            return False
        if loading.stream.given_tokens is not None:
            raise ValueError(f"request_id: {request_id!r} was given its first tokens already")
        request = loading.request
        check_given_tokens(len(request.prompt_token_ids), given_tokens, request.params,
                           self.vocab_size, max_model_len, first_only=True)
        loading.stream.given_tokens = [list(t) for t in given_tokens]
        loading.request = dataclasses.replace(request, given_tokens=loading.stream.given_tokens)
        return True

    def _advance_stream(self, request_id: str, loading: Loading) -> bool:
        """Land a streamed pull's finished batch and start the next; True when the request
        is to be placed now (its KV all landed, or failed, and its first tokens came)."""
        stream = loading.stream
        assert stream is not None and self.connector is not None
        if loading.future is not None:
            if not loading.future.done():
                return False
            stream.batch_landed(loading.future)
            loading.future = None
        if loading.abandoned:
            del self.loading[request_id]
            if not stream.blocks_freed:
                self.kv_manager.free(loading.parent.seq_id)
            return False
        if stream.error:
            if not stream.blocks_freed:  # never cached: they go back clean, now
                self.kv_manager.free(loading.parent.seq_id)
                stream.blocks_freed = True
        elif (batch := stream.next_batch()) is not None:
            first, end = batch
            loading.future = self.connector.start_load(stream.source, first,
                                                       stream.block_ids[first:end])
            return False
        return bool(stream.error or stream.whole) and stream.given_tokens is not None

    def futures(self) -> list[Future[int]]:
        """The pulls running on the connector's threads."""
        return [loading.future for loading in self.loading.values()
                if loading.future is not None]

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
            if loading.stream is not None:
                if not self._advance_stream(request_id, loading):
                    continue
                self._land_stream(request_id, loading)
                placed.append(request_id)
                continue
            assert loading.future is not None
            if not loading.future.done():
                continue
            del self.loading[request_id]
            parent, request = loading.parent, loading.request
            error = loading.future.exception()
            if loading.abandoned:
                self.kv_manager.free(parent.seq_id)
                continue
            if loading.prefix:
                self._land_prefix(loading, error)
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
                    reason=failure_reason(error), seconds=seconds)
            self._place_and_replay(loading, error is None)
            placed.append(request_id)
        return placed

    def _land_prefix(self, loading: Loading, error: BaseException | None) -> None:
        """A lent prefix landed (cached now, then the blocks go back to the pool as any
        finished prompt's do, findable by hash) or failed (they go back clean): either way
        the prompt is queued, and the scheduler's prefix lookup finds what was pulled."""
        assert loading.future is not None and loading.request.prefix_source is not None
        parent = loading.parent
        seconds = time.monotonic() - loading.started
        if error is None:
            self.kv_manager.cache_full_blocks(parent, loading.request.prefix_source.num_tokens)
            loading.state.kv_load = LoadResult(loading.reused, loading.pulled,
                                               loading.future.result(), seconds)
        else:
            loading.state.kv_load = LoadResult(
                reused_blocks=loading.reused, error=f"{type(error).__name__}: {error}",
                reason=failure_reason(error), seconds=seconds)
        self.kv_manager.free(parent.seq_id)
        self.scheduler.add(parent)

    def _land_stream(self, request_id: str, loading: Loading) -> None:
        """A streamed pull is whole (or failed) and its first tokens came: place it."""
        stream = loading.stream
        assert stream is not None
        del self.loading[request_id]
        seconds = time.monotonic() - loading.started
        num_prompt = len(loading.request.prompt_token_ids)
        if not stream.error:
            self.kv_manager.cache_full_blocks(loading.parent, num_prompt)
            loading.state.kv_load = LoadResult(
                loading.reused, loading.pulled, stream.nbytes, seconds, streamed=True,
                pulled_before_seal=stream.pulled_before_seal)
        else:
            loading.state.kv_load = LoadResult(
                reused_blocks=loading.reused, error=stream.error, reason=stream.reason,
                seconds=seconds, streamed=True)
        self._place_and_replay(loading, not stream.error)

    def _place_and_replay(self, loading: Loading, loaded: bool) -> None:
        request = loading.request
        self._place_parent(loading.state, request, loading.parent, loaded)
        try:
            for seq, tokens in zip(list(loading.state.seqs), request.given_tokens or [],
                                   strict=True):
                self._replay(seq, tokens)
        except ValueError as exc:  # cannot happen for the prefill's own first tokens
            logger.warning("request_id=%s: its given tokens were refused after its KV "
                           "landed: %s", request.request_id, exc)
            for seq in loading.state.seqs:
                if not seq.status.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

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

