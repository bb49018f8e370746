"""The prefill role's exported KV: blocks a finished request keeps pinned for a decode instance.

A request run with `export_kv` stops after its first token with its blocks pinned (its state
stays in the core's `requests`). From there the serving process either reads the KV out
(`read`: a staged transport) or lends the blocks to the core's KV connector (`lend`: peers
pull them straight from the cache); a lent export leaves `requests`, so its id is free again
(a colocated instance decodes it next). `release` frees the blocks either way, once.

A *prefix loan* (`lend_prefix`) lends blocks no request of this core owns: the leading blocks
of a peer's prompt that this core's prefix cache holds (turn N's prompt and answer on the
decode instance that wrote them, when turn N+1 is prefilled elsewhere). They are pinned like
an export under the loan's id and released the same way.

A *streamed* export (`EngineRequest.stream_kv`) is lent while its prompt is computed: it is
announced (an empty report) before the step that starts its prompt runs
(`announce_scheduled`), so the decode side's transfer starts while the first chunk computes;
after every step the blocks its prefill has filled are checksummed and served
(`advance_streams`, reported in the request's `CoreOutput.kv_stream`), so a decode core pulls
one chunk's blocks while the next computes; when the prefill ends the last (partial) block
follows and the export is sealed and lent as above. A preempted prefill frees its blocks, so
its stream fails at once (nothing more is served); the request itself goes on as a plain
export.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from pdmesh.engine.core.request_state import CoreRequest
from pdmesh.engine.core_types import CoreOutput, KVExportInfo
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.scheduling.sequence import Sequence
from pdmesh.kvstore.connector.connector import ExportInfo, KVConnector
from pdmesh.kvstore.connector.export_info import ExportProgress, PrefixLoan


@dataclass
class ExportStream:
    """How far a streamed export's blocks have been handed to the connector."""

    state: CoreRequest
    block_ids: list[int] = field(default_factory=list)
    checksums: list[int] = field(default_factory=list)
    failed: str = ""
    announced: bool = False  # its prompt was scheduled and said so (`announce_scheduled`)


class KVExports:
    def __init__(self, requests: dict[str, CoreRequest], kv_manager: KVCacheManager,
                 kv_cache: torch.Tensor, connector: KVConnector | None) -> None:
        self.requests = requests  # the core's own dict
        self.kv_manager = kv_manager
        self.kv_cache = kv_cache
        self.connector = connector
        self.lent: dict[str, CoreRequest] = {}
        self.streams: dict[str, ExportStream] = {}  # streamed exports still growing
        self._sealed: dict[str, ExportInfo] = {}  # streamed exports lent at their seal

    def _exported(self, request_id: str) -> CoreRequest:
        state = self.requests.get(request_id)
        if state is None or state.kv_export is None:
            raise KeyError(f"request {request_id!r} has no exported KV")
        return state

    def read(self, request_id: str) -> torch.Tensor:
        """KV of an exported request: `[layers, 2, n_blocks, block_size, kv_heads, head_dim]`."""
        state = self._exported(request_id)
        assert state.kv_export is not None
        if self.connector is not None and self.connector.ranks.world > 1:
            return self.connector.ranks.canonical(state.kv_export.block_ids)  # every rank's
        ids = torch.tensor(state.kv_export.block_ids, device=self.kv_cache.device)
        return self.kv_cache.index_select(2, ids)

    def lend(self, request_id: str) -> ExportInfo:
        """Lend an exported request's blocks to the KV connector: peers pull them straight
        from the cache until `release`. The answer carries one checksum per block."""
        sealed = self._sealed.get(request_id)
        if sealed is not None:  # a streamed export, lent when its prefill ended
            return sealed
        state = self._exported(request_id)
        assert state.kv_export is not None
        if self.connector is None:
            raise ValueError("export_kv: this engine has no KV connector")
        self.lent[request_id] = self.requests.pop(request_id)
        return self.connector.export(request_id, list(state.kv_export.block_ids),
                                     state.kv_export.num_tokens)

    def lend_prefix(self, lend_id: str, seq: Sequence, min_blocks: int,
                    max_blocks: int) -> PrefixLoan:
        """Lend the leading blocks of `seq`'s tokens this core holds in its prefix cache (an
        offload tier's hits restored first) to the KV connector, pinned as an export under
        `lend_id` until `release`: a peer that lacks them pulls them instead of recomputing
        (cluster-wide prefix caching). Fewer than `min_blocks` held: nothing is lent."""
        if self.connector is None:
            raise ValueError("lend_prefix: this engine has no KV connector")
        if lend_id in self.lent or lend_id in self.requests:
            raise ValueError(f"lend_id: {lend_id!r} is already in use")
        algo = str(self.connector.algo)
        hits = self.kv_manager.find_cached_prefix(seq)[:max_blocks or None]
        if not hits or len(hits) < min_blocks or not self.kv_manager.allocate_slots(
                seq, 0, hits, cache=False):  # (evictable hits, and no room to pin them now)
            self.kv_manager.free(seq.seq_id)  # the walk's hashes
            return PrefixLoan([], [], algo)
        block_ids = [b.block_id for b in hits]
        num_tokens = len(block_ids) * self.kv_manager.block_size
        state = CoreRequest(lend_id, list(seq.token_ids[:num_tokens]), seq.params, [seq],
                            kv_export=KVExportInfo(block_ids, num_tokens))
        self.lent[lend_id] = state
        info = self.connector.export(lend_id, block_ids, num_tokens)
        return PrefixLoan(block_ids, info.block_checksums, info.checksum_algo)

    def release(self, request_id: str) -> bool:
        """Free an exported request's pinned blocks (they stay in the prefix cache)."""
        state = self.lent.pop(request_id, None)
        self._sealed.pop(request_id, None)
        if state is None:
            state = self.requests.get(request_id)
            if state is None or state.kv_export is None:
                return False
            self.requests.pop(request_id)
        if self.connector is not None:
            self.connector.release(request_id)
        self.kv_manager.free(state.seqs[0].seq_id)
        return True

    # -- streamed exports -------------------------------------------------------------------
    def open_stream(self, state: CoreRequest) -> None:
        """Serve `state`'s prompt blocks as its prefill fills them (it was just admitted)."""
        if self.connector is None:
            raise ValueError("stream_kv: this engine has no KV connector")
        self.connector.open_stream(state.request_id, len(state.prompt_token_ids))
        self.streams[state.request_id] = ExportStream(state)

    def fail_stream(self, request_id: str, reason: str) -> None:
        """The prefill lost its blocks (preempted): serve nothing more, say so next step."""
        stream = self.streams.get(request_id)
        if stream is not None and not stream.failed:
            stream.failed = reason
            assert self.connector is not None
            self.connector.release(request_id)

    def drop_stream(self, request_id: str) -> None:
        """The request was aborted (the caller releases it from the connector)."""
        self.streams.pop(request_id, None)

    def announce_scheduled(self, scheduled: Iterable[str]) -> list[CoreOutput]:
        """An empty report (no block ready yet) for each streamed export whose prompt the
        coming step starts computing, sent before the step runs: the serving process then
        publishes the export, and the router's Decode call, StartTransfer and WatchTransfer
        happen while the first chunk computes, not after it (for a prompt of one chunk: not
        after the whole prefill). A prompt still queued is not announced: it engages nothing
        on the decode side while it waits."""
        out: list[CoreOutput] = []
        for request_id in scheduled:
            stream = self.streams.get(request_id)
            if stream is None or stream.announced or stream.failed:
                continue
            stream.announced = True
            assert self.connector is not None
            out.append(CoreOutput(request_id, kv_stream=ExportProgress(
                0, checksum_algo=str(self.connector.algo))))
        return out

    def advance_streams(self) -> dict[str, ExportProgress]:
        """After a step: each streamed export's newly filled blocks, checksummed and served;
        a prefill that ended seals its export (and lends it), a failed one is reported once."""
        progress: dict[str, ExportProgress] = {}
        for request_id, stream in list(self.streams.items()):
            first = len(stream.block_ids)
            if stream.failed:
                del self.streams[request_id]
                progress[request_id] = ExportProgress(first, failed=stream.failed)
                continue
            state = stream.state
            seq = state.seqs[0]
            if state.kv_export is not None:  # the prefill ended: every block, the last too
                ready = self.kv_manager.num_blocks_for(state.kv_export.num_tokens)
                ids = state.kv_export.block_ids[:ready]
            else:
                ready = min(seq.num_computed_tokens, seq.num_prompt_tokens) \
                    // self.kv_manager.block_size
                ids = self.kv_manager.block_ids(seq.seq_id)[:ready] if ready > first else []
            new = list(ids[first:])
            if not new and state.kv_export is None:
                continue
            assert self.connector is not None
            sums = self.connector.extend_stream(request_id, new) if new else []
            stream.block_ids += new
            stream.checksums += sums
            algo = str(self.connector.algo)
            if state.kv_export is not None:
                del self.streams[request_id]
                self.lent[request_id] = self.requests.pop(request_id)
                self._sealed[request_id] = ExportInfo(list(stream.checksums), algo)
            progress[request_id] = ExportProgress(first, new, sums, algo,
                                                  sealed=state.kv_export is not None)
        return progress

    def with_progress(self, outputs: list[CoreOutput]) -> list[CoreOutput]:
        """A step's outputs with each streamed export's progress (`advance_streams`): set on
        the request's own output, or an output of its own when the step had none for it."""
        if not self.streams:
            return outputs
        progress = self.advance_streams()
        for out in outputs:
            out.kv_stream = progress.pop(out.request_id, None)
        outputs.extend(CoreOutput(rid, kv_stream=p) for rid, p in progress.items())
        return outputs

    def any_pinned(self) -> bool:
        return bool(self.lent) or any(s.kv_export is not None for s in self.requests.values())

    def pinned_blocks(self) -> int:
        return sum(len(s.kv_export.block_ids) for s in (*self.requests.values(),
                                                        *self.lent.values())
                   if s.kv_export is not None)
