"""What the block pool asks of a KV offload tier: keep an evicted block, give it back on a hit.

The pool decides *when* bytes move (it knows which block is evicted and which hash a prompt
misses); the tier behind this protocol moves them (engine/core/kv_offload.py, which needs torch,
so the scheduling room only sees this interface). Both calls are synchronous from the pool's
view: `save` returns before the evicted block can be handed to its next owner, and `restore`
before the restored block is returned as a prefix hit, so no step, KV pull or fork ever sees a
block whose bytes are still moving. (On CUDA the copies run on a side stream that the engine's
stream waits on: synchronous in stream order, not on the host.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdmesh.engine.block_hash import BlockHash
from pdmesh.engine.kv_events import KVEvent, Medium


class KVTier(Protocol):
    """A bounded, LRU store of KV blocks keyed by their hash, behind the paged cache."""

    def save(self, block_id: int, block_hash: BlockHash) -> None:
        """Keep a copy of paged block `block_id`, which holds `block_hash` and is about to be
        reused (a hash the tier holds already is only marked recently used)."""

    def holds(self, block_hash: BlockHash) -> Medium | None:
        """The fastest tier medium holding the hash, or None."""

    def prefer(self, block_hashes: Sequence[BlockHash]) -> None:
        """Mark these hashes most recently used (the ones held): a prompt about to restore
        them must not see its own restores' evictions push them out."""

    def restore(self, block_hash: BlockHash, block_id: int) -> bool:
        """Copy the block into paged block `block_id`; False (a miss, counted) when the tier
        no longer holds it or its checksum fails."""

    def clear(self) -> None:
        """Forget every block (the prefix cache was reset)."""

    def held_hashes(self) -> dict[Medium, list[BlockHash]]:
        """Every hash held, by medium (a snapshot for the cluster index)."""

    def take_events(self) -> list[KVEvent]:
        """The tier's KV events since the last call (`medium` = host or disk)."""

    def figures(self) -> TierFigures:
        """Counters and occupancy for the engine's load snapshot and metrics."""


@dataclass(frozen=True)
class TierFigures:
    """Cumulative counters (since start) and occupancy of the offload tiers."""

    host_blocks: int = 0  # held now
    host_capacity_blocks: int = 0
    disk_blocks: int = 0
    disk_capacity_blocks: int = 0
    host_saved_blocks: int = 0  # paged -> host copies
    disk_saved_blocks: int = 0  # host -> disk spills
    host_restored_blocks: int = 0  # host -> paged copies that served a prefix hit
    disk_restored_blocks: int = 0
    restore_failures: int = 0  # checksum mismatches or unreadable files: counted as misses
    block_bytes: int = 0  # bytes of one block
