"""The cluster-wide prefix index: which live instance holds which KV blocks, kept in Redis.

Engines publish `KVEventBatch`es; `apply` folds one into Redis atomically and tells the engine
when it must resend a full snapshot (a sequence gap, or an instance the index does not know —
its registration expired or Redis lost its data). The router asks `longest_prefix` how many
leading blocks of a prompt each live instance already holds; that is one round trip whatever
the prompt length, and the server stops looking at an instance at its first miss.

A snapshot is an ordinary batch: `[AllBlocksCleared(), BlockStored(every cached hash)]`, one
`BlockStored` per medium. `BlockStored.parent_hash` is not stored: a chained hash already
identifies its whole prefix. Events carry their medium (the paged cache, or the host or disk
offload tier, engine/kv_events.py); `longest_prefix_by_medium` says how many of an instance's
leading blocks each medium serves, for routing that weighs a hit by its tier.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pdmesh.engine.block_hash import BlockHash
from pdmesh.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from pdmesh.kvstore import redis_schema
from pdmesh.kvstore.redis_conn import IndexUnavailable, RedisConnection
from pdmesh.kvstore.redis_schema import MEDIUM_OP, KeySpace

logger = logging.getLogger(__name__)


class ApplyStatus(enum.Enum):
    APPLIED = "applied"
    GAP = "gap"  # applied, but batches in between were lost: the index may be stale
    DUPLICATE = "duplicate"  # this seq (or a later one) was applied already: ignored
    UNKNOWN_INSTANCE = "unknown_instance"  # not registered (expired / Redis restarted): ignored


@dataclass(frozen=True)
class ApplyResult:
    status: ApplyStatus
    previous_seq: int | None  # last seq applied before this batch, None if there was none

    @property
    def needs_snapshot(self) -> bool:
        """The engine must resend its full state (after re-registering if unknown)."""
        return self.status in (ApplyStatus.GAP, ApplyStatus.UNKNOWN_INSTANCE)

    @property
    def needs_register(self) -> bool:
        return self.status is ApplyStatus.UNKNOWN_INSTANCE


def encode_events(events: Sequence[KVEvent]) -> list[str]:
    """Flatten events into the APPLY_EVENTS script's argument format (hashes as hex)."""
    args: list[str] = []
    for event in events:
        if isinstance(event, AllBlocksCleared):
            args.append("C")
        elif isinstance(event, BlockStored | BlockRemoved):
            op = "S" if isinstance(event, BlockStored) else "R"
            args.append(op + MEDIUM_OP[event.medium])
            args.append(str(len(event.block_hashes)))
            args.extend(h.hex() for h in event.block_hashes)
        else:
            raise TypeError(f"unknown KV event type: {type(event).__name__}")
    return args


@dataclass(frozen=True)
class PrefixHits:
    """An instance's leading run of a prompt's blocks, split by the fastest medium holding
    each block (a block both paged and in the host tier counts as paged)."""

    paged: int = 0
    host: int = 0
    disk: int = 0

    @property
    def blocks(self) -> int:
        return self.paged + self.host + self.disk


def decode_prefix_reply(reply: list[str | int]) -> dict[str, PrefixHits]:
    """`[id, n, n_paged, n_host, n_disk, ...]` -> `{id: PrefixHits}`."""
    out = {}
    for i in range(0, len(reply), 5):
        hits = PrefixHits(int(reply[i + 2]), int(reply[i + 3]), int(reply[i + 4]))
        if hits.blocks != int(reply[i + 1]):
            raise ValueError(f"prefix lookup reply: {reply[i + 1]} blocks for {hits}")
        out[str(reply[i])] = hits
    return out


class PrefixIndex:
    """Block hash -> live instances holding it, for one model."""

    def __init__(self, conn: RedisConnection, keys: KeySpace) -> None:
        self._conn = conn
        self._keys = keys
        self._apply = conn.script(redis_schema.APPLY_EVENTS)
        self._lookup = conn.script(redis_schema.LONGEST_PREFIX)
        self._purge_dead = conn.script(redis_schema.PURGE_DEAD)

    @property
    def keys(self) -> KeySpace:
        return self._keys

    async def apply(self, batch: KVEventBatch) -> ApplyResult:
        """Apply one engine's event batch; see `ApplyResult.needs_snapshot`."""
        args = [self._keys.prefix, batch.instance_id, str(batch.seq), *encode_events(batch.events)]
        status, previous = await self._conn.call(
            "apply kv events", lambda _: self._apply(keys=[], args=args)
        )
        result = ApplyResult(ApplyStatus(status), None if int(previous) < 0 else int(previous))
        if result.status is ApplyStatus.GAP:
            logger.info(
                "kv event gap for %s: seq %d after %s", batch.instance_id, batch.seq, previous
            )
        return result

    async def longest_prefix(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Leading blocks of `hashes` held by each live instance, in any medium; instances
        holding none of them are absent. Dead holders met on the way are purged."""
        hits = await self.longest_prefix_by_medium(hashes)
        return {instance_id: h.blocks for instance_id, h in hits.items()}

    async def longest_prefix_by_medium(self, hashes: Sequence[BlockHash]
                                       ) -> dict[str, PrefixHits]:
        """`longest_prefix`, with each instance's run split by medium (one round trip)."""
        if not hashes:
            return {}
        block_keys = [self._keys.block(h) for h in hashes]
        args = [self._keys.prefix, *(h.hex() for h in hashes)]
        counts, dead = await self._conn.call(
            "prefix lookup", lambda _: self._lookup(keys=block_keys, args=args)
        )
        if dead:
            await self._purge(dead)
        return decode_prefix_reply(counts)

    async def ask_republish(self, instance_id: str, ttl_s: float) -> bool:
        """Ask `instance_id` to re-publish its slice of the index (a full snapshot): its next
        heartbeat sees the ask, its snapshot clears it. The ask lapses after `ttl_s` (an
        instance that died never answers). False when an ask was already waiting."""
        key = self._keys.republish(instance_id)
        ttl_ms = max(1, round(ttl_s * 1000))
        created = await self._conn.call(
            "ask republish", lambda r: r.set(key, "1", nx=True, px=ttl_ms))
        return bool(created)

    async def _purge(self, instance_ids: list[str]) -> None:
        """Lazy cleanup; the lookup already has its answer, so an outage here is not fatal."""
        try:
            purged = await self._conn.call(
                "purge dead instances",
                lambda _: self._purge_dead(keys=[], args=[self._keys.prefix, *instance_ids]),
            )
        except IndexUnavailable as exc:
            logger.debug("lazy purge of %s skipped: %s", instance_ids, exc)
            return
        if purged:
            logger.info("purged expired instances from the prefix index: %s", purged)
