"""KV cache events an engine publishes so the cluster-wide prefix index stays current.

The block pool records an event whenever a full block becomes findable by its hash
(`BlockStored`), stops being findable because it was evicted (`BlockRemoved`), or the whole
cache was reset (`AllBlocksCleared`). Batches carry a per-instance sequence number so a
consumer can detect gaps and resynchronise instead of silently drifting.

Each stored/removed event names the *medium* that gained or lost the blocks (vLLM's KV events
carry the same `medium` field): the paged cache the model reads, or one of the offload tiers
behind it (engine/core/kv_offload.py). A block moved from the paged cache to the host tier is
`BlockRemoved(medium="paged")` then `BlockStored(medium="host")`; the router weighs a hit by
the fastest medium holding it (router/routing/README.md). `AllBlocksCleared` clears every medium.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pdmesh.engine.block_hash import BlockHash

Medium = Literal["paged", "host", "disk"]

MEDIUM_PAGED: Medium = "paged"
"""The engine's paged KV cache, on its device (vLLM calls it "GPU"; also on a CPU engine)."""
MEDIUM_HOST: Medium = "host"
"""The host-memory offload tier (vLLM's "CPU"): a restore is one copy into the paged cache."""
MEDIUM_DISK: Medium = "disk"
"""The local-disk offload tier: a restore reads a file, checks it, then copies."""
MEDIA: tuple[Medium, ...] = (MEDIUM_PAGED, MEDIUM_HOST, MEDIUM_DISK)
"""Fastest first: the order hits are weighed in."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None = None
    medium: Medium = field(default=MEDIUM_PAGED)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: Medium = field(default=MEDIUM_PAGED)


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventBatch:
    instance_id: str
    seq: int
    events: list[KVEvent] = field(default_factory=list)
