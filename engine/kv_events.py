"""KV cache events an engine publishes so the cluster-wide prefix index stays current.

The block pool records an event whenever a full block becomes findable by its hash
(`BlockStored`), stops being findable because it was evicted (`BlockRemoved`), or the whole
cache was reset (`AllBlocksCleared`). Batches carry a per-instance sequence number so a
consumer can detect gaps and resynchronise instead of silently drifting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdmesh.engine.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventBatch:
    instance_id: str
    seq: int
    events: list[KVEvent] = field(default_factory=list)
