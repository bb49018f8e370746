"""What each sequence needs from the block pool: allocation, prefix-cache hits, forks, frees.

The scheduler talks only to this manager, never to blocks. Block hashes of a sequence are
computed incrementally as its tokens grow, and full blocks are registered in the cache at
allocation time (their tokens are known when the step is scheduled).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdmesh.engine.block_hash import BlockHash, HashScheme, hash_token_blocks
from pdmesh.engine.scheduling.block_pool import BlockPool, KVBlock
from pdmesh.engine.scheduling.kv_tier import KVTier
from pdmesh.engine.scheduling.sequence import Sequence


@dataclass
class PrefixCacheStats:
    """Counters in tokens, so a hit *rate* is hits / queries."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self, num_blocks: int, scheme: HashScheme, enable_prefix_caching: bool = True,
        tier: KVTier | None = None,
    ) -> None:
        """`tier`: the offload tier behind the paged cache (engine/scheduling/kv_tier.py):
        evicted prefixes are saved there and a prefix walk continues through its hits."""
        self.block_size = scheme.block_size
        self.scheme = scheme
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching, tier=tier)
        self.stats = PrefixCacheStats()
        # Prompt tokens whose KV came back from the offload tier instead of being recomputed.
        self.tier_restored_tokens = 0
        self._blocks: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached: dict[str, int] = {}
        # Called with the seq_id after a sequence's blocks are freed (finished, preempted,
        # aborted): the model runner's persistent batch drops that sequence's row.
        self._free_listeners: list[Callable[[str], None]] = []

    def add_free_listener(self, listener: Callable[[str], None]) -> None:
        self._free_listeners.append(listener)

    # -- queries ---------------------------------------------------------------------------
    def block_ids(self, seq_id: str, start: int = 0) -> list[int]:
        """The sequence's block ids, from its `start`-th block on."""
        return [b.block_id for b in self._blocks.get(seq_id, ())[start:]]

    def num_seq_blocks(self, seq_id: str) -> int:
        return len(self._blocks.get(seq_id, ()))

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def _seq_hashes(self, seq: Sequence) -> list[BlockHash]:
        hashes = self._hashes.setdefault(seq.seq_id, [])
        if len(hashes) < seq.num_tokens // self.block_size:
            parent = hashes[-1] if hashes else None
            hashes += hash_token_blocks(
                self.scheme, seq.token_ids, seq.cache_salt, parent, start_block=len(hashes)
            )
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock]:
        """Longest run of cached blocks at the start of `seq`, leaving >= 1 token to compute.

        With an offload tier the run goes on through blocks the tier holds: each is restored
        into a free block here (its bytes copied back before this returns), so to the caller
        it is an ordinary cached hit and its tokens are not recomputed.
        """
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            # Prompt logprobs need logits for every prompt position, so no skipping.
            return []
        hashes = self._seq_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        held: list[KVBlock] = []  # hits referenced while restores allocate (none evicts them)
        restoring = False
        for i, block_hash in enumerate(hashes[:max_blocks]):
            block = self.pool.get_cached_block(block_hash)
            if block is None and self.pool.tier is not None:
                if not restoring:
                    restoring = True
                    self.pool.tier.prefer(hashes[i:max_blocks])
                    self.pool.touch(hits)
                    held = list(hits)
                block = self.pool.restore(block_hash, hashes[i - 1] if i else None)
                if block is not None:
                    self.pool.touch([block])
                    held.append(block)
                    self.tier_restored_tokens += self.block_size
            if block is None:
                break
            hits.append(block)
        self.pool.free(reversed(held))
        return hits

    def record_prefix_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_prompt_tokens
        self.stats.hits += num_hit_tokens

    # -- allocation --------------------------------------------------------------------------
    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: list[KVBlock] | None = None,
        *, cache: bool = True,
    ) -> bool:
        """Ensure `seq` has blocks for its computed tokens + `num_new_tokens`; False if full.

        `cached_blocks` are prefix-cache hits for a sequence that has no blocks yet. With
        `cache=False` the new full blocks are not findable by hash until `cache_full_blocks`:
        blocks whose KV is still being pulled from a peer must not serve prefix hits.
        """
        cached_blocks = cached_blocks or []
        blocks = self._blocks.setdefault(seq.seq_id, [])
        num_computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        needed = self.num_blocks_for(num_computed + num_new_tokens)
        num_new_blocks = needed - len(blocks) - len(cached_blocks)
        # Hit blocks that are currently free come out of the free queue too.
        evictable_hits = sum(1 for b in cached_blocks if b.ref_cnt == 0)
        if num_new_blocks + evictable_hits > self.pool.num_free_blocks:
            if not blocks:
                del self._blocks[seq.seq_id]
            return False
        self.pool.touch(cached_blocks)
        blocks += cached_blocks
        if num_new_blocks > 0:
            blocks += self.pool.allocate(num_new_blocks)
        if cache:
            self._cache_full_blocks(seq, num_computed + num_new_tokens)
        return True

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Make `seq`'s full blocks up to `num_tokens` findable by their hashes."""
        self._cache_full_blocks(seq, num_tokens)

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        blocks = self._blocks[seq.seq_id]
        num_full = min(num_tokens, seq.num_tokens) // self.block_size
        start = self._num_cached.get(seq.seq_id, 0)
        if num_full <= start:
            return
        hashes = self._seq_hashes(seq)
        parent = hashes[start - 1] if start else None
        self.pool.cache_blocks(blocks[start:num_full], hashes[start:num_full], parent)
        self._num_cached[seq.seq_id] = num_full

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Share the parent's blocks with `child`; copy-on-write for a partial last block.

        Returns `(src_block, dst_block)` when the partial last block had to be copied (the caller
        copies the KV), or None. Raises RuntimeError when no block is free for the copy.
        """
        blocks = self._blocks[parent.seq_id]
        num_full = parent.num_computed_tokens // self.block_size
        shared = blocks[:num_full]
        copy = None
        child_blocks = list(shared)
        if len(blocks) > num_full:
            if self.pool.num_free_blocks < 1:
                raise RuntimeError("no free block to fork a sequence")
            (new_block,) = self.pool.allocate(1)
            copy = (blocks[num_full].block_id, new_block.block_id)
            child_blocks.append(new_block)
        self.pool.touch(shared)
        self._blocks[child.seq_id] = child_blocks
        self._hashes[child.seq_id] = list(self._hashes.get(parent.seq_id, []))[:num_full]
        self._num_cached[child.seq_id] = min(self._num_cached.get(parent.seq_id, 0), num_full)
        return copy

    def free(self, seq_id: str) -> None:
        """Return every block of the sequence; its full blocks stay findable until evicted."""
        blocks = self._blocks.pop(seq_id, [])
        self.pool.free(reversed(blocks))
        self._hashes.pop(seq_id, None)
        self._num_cached.pop(seq_id, None)
        for listener in self._free_listeners:
            listener(seq_id)

    def has_blocks(self, seq_id: str) -> bool:
        return seq_id in self._blocks
