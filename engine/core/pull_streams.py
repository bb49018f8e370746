"""A streamed pull's progress: the blocks a still-computing prefill has made ready, and ours.

A *streamed* source (`KVSource.streamed`) grows while the decode core already holds the
prompt's blocks: the sender's `ExportProgress` messages extend the source's checksums (an shm
source: its block ids too) until it is sealed or fails (`take_progress`); `Admission` pulls
each batch of newly known blocks on the connector's threads (`next_batch`, `batch_landed`) and
places the request once the export is whole, or failed, and its first tokens came. A stream
that fails keeps its first error (`fail`): its blocks are freed and the prompt recomputed.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import msgspec

from pdmesh.kvstore.connector.export_info import ExportProgress
from pdmesh.kvstore.connector.source import KVSource, encode_blocks
from pdmesh.kvstore.transfer.errors import KVTransferError, failure_outcome


@dataclass
class PullStream:
    """A streamed pull's progress: what the sender has made ready, what this core pulled."""

    source: KVSource            # the checksums (an shm source: the block ids) known so far
    block_ids: list[int]        # the parent's blocks, by export index (hits first)
    next_block: int             # export index of the first block not asked for yet
    src_ids: list[int] = field(default_factory=list)  # the sender's block ids so far
    sealed: bool = False
    error: str = ""             # why the stream failed (then its blocks are freed)
    reason: str = ""
    blocks_freed: bool = False
    batch: int = 0              # blocks in the batch in flight
    batch_before_seal: bool = False
    pulled_before_seal: int = 0
    nbytes: int = 0
    given_tokens: list[list[int]] | None = None

    @classmethod
    def opened(cls, source: KVSource, block_ids: list[int], num_hits: int) -> PullStream:
        """A stream whose leading `num_hits` blocks are this core's own prefix hits; an shm
        source names the sender's blocks ready by then (the rest come as progress)."""
        blocks = source.params.get("blocks", "")
        known = len(source.block_checksums)
        return cls(source, block_ids, num_hits,
                   src_ids=[int(b) for b in blocks.split(",") if b][:known])

    def fail(self, error: str, reason: str) -> None:
        """Keep the first failure: it is the one the request's `LoadResult` reports."""
        if not self.error:
            self.error, self.reason = error, reason

    def take_progress(self, progress: ExportProgress) -> None:
        """The sender's export grew, sealed or failed; progress out of order fails the stream."""
        if self.error:
            return
        known = len(self.source.block_checksums)
        total = len(self.block_ids)
        count = len(progress.block_checksums)
        if progress.failed:
            self.fail(f"the sender's export failed: {progress.failed}", "export_failed")
        elif progress.first_index != known or known + count > total or (
                len(progress.block_ids) != count):
            self.fail(f"progress for blocks [{progress.first_index}, "
                      f"{progress.first_index + count}) after {known} of {total}",
                      "invalid_source")
        elif self.sealed and count:
            self.fail("progress after the seal", "invalid_source")
        else:
            sums = [*self.source.block_checksums[:known], *progress.block_checksums]
            self.src_ids = [*self.src_ids[:known], *progress.block_ids]
            params = self.source.params
            if self.source.backend == "shm":
                params = {**params, "blocks": encode_blocks(self.src_ids)}
            self.source = msgspec.structs.replace(self.source, block_checksums=sums,
                                                  params=params)
            if progress.sealed:
                if len(sums) != total:
                    self.fail(f"sealed with {len(sums)} of {total} blocks", "invalid_source")
                self.sealed = True

    def batch_landed(self, future: Future[int]) -> None:
        """The batch in flight ended: count its bytes, or fail the stream with its error."""
        error = future.exception()
        if error is None:
            self.nbytes += future.result()
            if self.batch_before_seal:
                self.pulled_before_seal += self.batch
        else:
            self.fail(f"{type(error).__name__}: {error}", failure_reason(error))

    def next_batch(self) -> tuple[int, int] | None:
        """The export indices [first, end) of the newly known blocks to pull next, if any."""
        if len(self.source.block_checksums) <= self.next_block:
            return None
        first, end = self.next_block, len(self.source.block_checksums)
        self.batch, self.batch_before_seal = end - first, not self.sealed
        self.next_block = end
        return first, end

    @property
    def whole(self) -> bool:
        """Sealed and every block asked for (the last batch has landed by then)."""
        return self.sealed and self.next_block == len(self.block_ids)


def failure_reason(exc: BaseException) -> str:
    """The label a failed pull is counted under (the transfer layer's vocabulary)."""
    return failure_outcome(exc) if isinstance(exc, KVTransferError) else "invalid_source"
