"""Prompts whose KV this core's connector is pulling: started, advanced, landed.

Three kinds of pull, each into fresh blocks that become findable by hash only once their KV
checks out (`cache=False` until then), and each leaving the prompt to be computed here when it
fails:

* a *lent prefix* (`EngineRequest.prefix_source`: a peer holds the prompt's leading blocks):
  the blocks our prefix cache lacks are pulled, cached once they land, and the prompt is then
  queued like any other, its prefix a cache hit;
* an *import* (`EngineRequest.kv_source`: the prefill instance computed the prompt): the blocks
  after our own prefix-cache hits are pulled, and the request is placed once they land
  (engine/core/admission.py places it);
* a *streamed* import (`KVSource.streamed`: the prefill is still computing the prompt): pulled
  batch by batch as the sender reports progress (`stream_progress`), each batch of newly ready
  blocks on the connector's threads while the core keeps stepping; placed once the export is
  sealed, every block has landed and checked, and its first tokens came
  (`stream_first_tokens`). The stream's own bookkeeping is engine/core/pull_streams.py.

An aborted request's blocks go back only once its pull has stopped writing into them
(`abandon`, then `landed`).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from dataclasses import dataclass

from pdmesh.engine.core.pull_streams import PullStream, failure_reason
from pdmesh.engine.core.request_state import CoreRequest
from pdmesh.engine.engine_request import EngineRequest, check_given_tokens
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.scheduling.scheduler import Scheduler
from pdmesh.engine.scheduling.sequence import Sequence
from pdmesh.kvstore.connector.connector import KVConnector
from pdmesh.kvstore.connector.export_info import ExportProgress
from pdmesh.kvstore.connector.source import LoadResult


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


@dataclass(frozen=True)
class Landed:
    """An imported prompt ready to place: its pull landed (`loaded`) or failed."""

    loading: Loading
    loaded: bool


class KVLoads:
    def __init__(self, scheduler: Scheduler, kv_manager: KVCacheManager,
                 connector: KVConnector | None, vocab_size: int) -> None:
        self.scheduler = scheduler
        self.kv_manager = kv_manager
        self.connector = connector
        self.vocab_size = vocab_size
        self.loading: dict[str, Loading] = {}  # pulls in flight, by request id

    def start_prefix_pull(self, state: CoreRequest, parent: Sequence,
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

    def start_pull(self, state: CoreRequest, parent: Sequence, request: EngineRequest) -> bool:
        """Our own prefix hits for the leading blocks, the rest pulled through the connector
        into fresh blocks that become findable by hash only once their KV checks out. False:
        no room now (the parent recomputes the prompt)."""
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

    # -- every pull --------------------------------------------------------------------------
    def futures(self) -> list[Future[int]]:
        """The pulls running on the connector's threads."""
        return [loading.future for loading in self.loading.values()
                if loading.future is not None]

    def abandon(self, request_id: str) -> bool:
        """The request was aborted while its KV is pulled: its blocks go back once the pull
        has stopped writing into them (`landed`). False if it is not loading."""
        loading = self.loading.get(request_id)
        if loading is None:
            return False
        loading.abandoned = True
        return True

    def landed(self) -> list[Landed]:
        """The pulls that finished (between two steps), each settled: on success the blocks
        are cached, on failure they go back clean (the prompt is recomputed). A lent prefix
        queues its prompt here; the imports are returned, for the caller to place."""
        ready = []
        for request_id, loading in list(self.loading.items()):
            if loading.stream is not None:
                if self._advance_stream(request_id, loading):
                    ready.append(self._land_stream(request_id, loading))
                continue
            assert loading.future is not None
            if not loading.future.done():
                continue
            del self.loading[request_id]
            error = loading.future.exception()
            if loading.abandoned:
                self.kv_manager.free(loading.parent.seq_id)
            elif loading.prefix:
                self._land_prefix(loading, error)
            else:
                ready.append(self._land_import(loading, error))
        return ready

    def _land_import(self, loading: Loading, error: BaseException | None) -> Landed:
        parent = loading.parent
        if error is None:
            self.kv_manager.cache_full_blocks(parent, len(loading.request.prompt_token_ids))
        else:
            self.kv_manager.free(parent.seq_id)  # never cached: the blocks go back clean
        loading.state.kv_load = _pull_result(loading, error)
        return Landed(loading, error is None)

    def _land_prefix(self, loading: Loading, error: BaseException | None) -> None:
        """A lent prefix landed (cached now, then the blocks go back to the pool as any
        finished prompt's do, findable by hash) or failed (they go back clean): either way
        the prompt is queued, and the scheduler's prefix lookup finds what was pulled."""
        assert loading.request.prefix_source is not None
        parent = loading.parent
        if error is None:
            self.kv_manager.cache_full_blocks(parent, loading.request.prefix_source.num_tokens)
        loading.state.kv_load = _pull_result(loading, error)
        self.kv_manager.free(parent.seq_id)
        self.scheduler.add(parent)

    def _land_stream(self, request_id: str, loading: Loading) -> Landed:
        """A streamed pull is whole (or failed) and its first tokens came."""
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
        return Landed(loading, not stream.error)


def _pull_result(loading: Loading, error: BaseException | None) -> LoadResult:
    """What a one-shot pull (an import, a lent prefix) did, for the request's report."""
    assert loading.future is not None
    seconds = time.monotonic() - loading.started
    if error is None:
        return LoadResult(loading.reused, loading.pulled, loading.future.result(), seconds)
    return LoadResult(reused_blocks=loading.reused, error=f"{type(error).__name__}: {error}",
                      reason=failure_reason(error), seconds=seconds)
