"""The physical KV blocks: reference counts, an O(1) LRU free queue, and the hash → block map.

A block whose last user freed it stays findable by its hash (prefix caching) until the
allocator needs it: free blocks queue in LRU order and are evicted from the head. When a
cached free block is hit again it leaves the *middle* of the queue, so the queue is an
intrusive doubly-linked list with sentinels (O(1) removal). Every change to what is findable
is recorded as a KV event for the cluster-wide index.

With an offload tier (engine/scheduling/kv_tier.py) an evicted cached block is first saved to
the tier, and a hash the cache misses but the tier holds is restored into a fresh block
(`restore`), which then serves as an ordinary cached block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pdmesh.engine.block_hash import BlockHash
from pdmesh.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdmesh.engine.scheduling.kv_tier import KVTier


class KVBlock:
    """One block of `block_size` token slots in every layer's cache."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return (
            f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"
        )


class FreeBlockQueue:
    """Doubly-linked list of free blocks; head = least recently used = next to evict."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        block.prev_free, block.next_free = last, self._tail
        last.next_free = self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise RuntimeError("no free blocks")
        self.remove(first)
        return first

    def __iter__(self):  # for tests and debugging
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 tier: KVTier | None = None) -> None:
        """`tier`: where evicted cached blocks go and come back from; None = they are lost."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self._events: list[KVEvent] = []
        self.tier = tier if enable_caching else None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by live requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"cannot allocate {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the tail of the LRU queue.

        Callers pass a sequence's blocks in reverse so its tail blocks, the least likely to be
        shared, are evicted first.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_blocks(
        self, blocks: Sequence[KVBlock], hashes: Sequence[BlockHash], parent: BlockHash | None
    ) -> None:
        """Make full blocks findable by their hashes (blocks[i] holds hashes[i])."""
        if not self.enable_caching:
            return
        stored = []
        for block, block_hash in zip(blocks, hashes, strict=True):
            if block.block_hash is not None:
                continue
            if block_hash in self.cached:
                # Another sequence computed the same block concurrently: keep the first copy.
                continue
            block.block_hash = block_hash
            self.cached[block_hash] = block
            stored.append(block_hash)
        if stored:
            self._events.append(BlockStored(tuple(stored), parent))

    def restore(self, block_hash: BlockHash, parent: BlockHash | None) -> KVBlock | None:
        """A free, cached block holding `block_hash` copied back from the tier; None when there
        is no tier, it lacks the hash (or fails its checksum), or no block is free. The block
        joins the tail of the LRU queue like any freed cached block."""
        if self.tier is None or self.num_free_blocks == 0 or block_hash in self.cached:
            return None
        if self.tier.holds(block_hash) is None:
            return None
        (block,) = self.allocate(1)  # may save the LRU head to the tier first
        if not self.tier.restore(block_hash, block.block_id):
            self.free([block])
            return None
        self.cache_blocks([block], [block_hash], parent)
        self.free([block])
        return block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            if self.tier is not None:
                self.tier.save(block.block_id, block.block_hash)
            del self.cached[block.block_hash]
            self._events.append(BlockRemoved((block.block_hash,)))
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while blocks are in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.tier is not None:
            self.tier.clear()
            self.tier.take_events()  # superseded by the clear
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The pool's events, then the tier's (each medium's own events stay in order)."""
        events, self._events = self._events, []
        if self.tier is not None:
            events += self.tier.take_events()
        return events
