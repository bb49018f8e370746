"""The block pool: ref counts, the O(1) LRU free queue, the hash map and the KV events."""

from __future__ import annotations

import pytest

from pdmesh.engine.block_hash import BlockHash, HashScheme, hash_token_blocks
from pdmesh.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pdmesh.engine.scheduling.block_pool import BlockPool, FreeBlockQueue, KVBlock

pytestmark = pytest.mark.fast

SCHEME = HashScheme(block_size=4)


def _hashes(n: int, first_token: int = 0) -> list[BlockHash]:
    return hash_token_blocks(SCHEME, list(range(first_token, first_token + 4 * n)))


def _ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


# -- FreeBlockQueue -------------------------------------------------------------------------


def test_free_queue_starts_in_id_order_and_pops_from_the_head() -> None:
    blocks = [KVBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert _ids(queue) == [0, 1, 2, 3]
    assert queue.num_free == 4
    assert queue.popleft() is blocks[0]
    assert _ids(queue) == [1, 2, 3]
    assert queue.num_free == 3


def test_free_queue_removes_from_the_middle_and_relinks_neighbours() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert _ids(queue) == [0, 1, 3, 4]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    queue.remove(blocks[0])  # head
    queue.remove(blocks[4])  # tail
    assert _ids(queue) == [1, 3]
    assert queue.num_free == 2
    queue.append(blocks[2])
    assert _ids(queue) == [1, 3, 2]
    # Walking backwards from the tail sees the same order reversed.
    back, node = [], blocks[2]
    while node is not None and node.block_id != -1:
        back.append(node.block_id)
        node = node.prev_free
    assert back == [2, 3, 1]


def test_free_queue_refuses_blocks_it_does_not_hold() -> None:
    blocks = [KVBlock(i) for i in range(2)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[0])
    with pytest.raises(RuntimeError, match="not in the free queue"):
        queue.remove(blocks[0])
    queue.popleft()
    with pytest.raises(RuntimeError, match="no free blocks"):
        queue.popleft()
    assert queue.num_free == 0


# -- BlockPool: ref counts -------------------------------------------------------------------


def test_allocate_takes_lru_blocks_and_sets_one_reference() -> None:
    pool = BlockPool(4)
    got = pool.allocate(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    with pytest.raises(RuntimeError, match="cannot allocate 2"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1  # a refused allocation takes nothing


def test_free_drops_one_reference_and_refuses_double_free() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.touch([block])  # a second user (a prefix hit)
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 1  # still in use
    pool.free([block])
    assert block.ref_cnt == 0
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([block])
    assert block.ref_cnt == 0
    assert pool.num_free_blocks == 2


def test_freed_blocks_join_the_tail_so_reversed_frees_evict_tail_blocks_first() -> None:
    pool = BlockPool(6)
    seq_a = pool.allocate(3)  # blocks 0, 1, 2
    seq_b = pool.allocate(2)  # blocks 3, 4
    assert _ids(pool.free_queue) == [5]
    pool.free(reversed(seq_a))
    pool.free(reversed(seq_b))
    # LRU: the never-used block first, then a's blocks tail-first, then b's (freed later).
    assert _ids(pool.free_queue) == [5, 2, 1, 0, 4, 3]
    assert [b.block_id for b in pool.allocate(3)] == [5, 2, 1]


# -- BlockPool: caching, eviction and events ---------------------------------------------------


def test_cache_blocks_emits_block_stored_with_parent() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    hashes = _hashes(3)
    pool.cache_blocks(blocks[:1], hashes[:1], parent=None)
    pool.cache_blocks(blocks[1:], hashes[1:], parent=hashes[0])
    assert pool.take_events() == [
        BlockStored((hashes[0],), None),
        BlockStored((hashes[1], hashes[2]), hashes[0]),
    ]
    assert pool.take_events() == []  # taking events drains them
    for block, block_hash in zip(blocks, hashes, strict=True):
        assert block.block_hash == block_hash
        assert pool.get_cached_block(block_hash) is block


def test_cache_blocks_skips_already_cached_blocks_and_duplicate_hashes() -> None:
    pool = BlockPool(4)
    first, twin = pool.allocate(2)
    (h0,) = _hashes(1)
    pool.cache_blocks([first], [h0], None)
    pool.cache_blocks([first], [h0], None)  # already cached: no second event
    pool.cache_blocks([twin], [h0], None)  # same content computed twice: keep the first copy
    assert pool.take_events() == [BlockStored((h0,), None)]
    assert pool.get_cached_block(h0) is first
    assert twin.block_hash is None
    # Freeing and reusing the uncached twin must not drop the first copy from the map.
    pool.free([twin])
    pool.allocate(pool.num_free_blocks)
    assert pool.get_cached_block(h0) is first
    assert pool.take_events() == []


def test_cache_blocks_is_a_no_op_without_prefix_caching() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.allocate(1)
    pool.cache_blocks(blocks, _hashes(1), None)
    assert pool.cached == {}
    assert blocks[0].block_hash is None
    assert pool.take_events() == []


def test_cached_free_block_stays_findable_until_evicted() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    hashes = _hashes(2)
    pool.cache_blocks(blocks, hashes, None)
    pool.take_events()
    pool.free(reversed(blocks))
    assert pool.num_free_blocks == 3
    assert _ids(pool.free_queue) == [2, 1, 0]
    # Free but findable.
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    # The never-cached block 2 goes first and evicts nothing.
    assert [b.block_id for b in pool.allocate(1)] == [2]
    assert pool.take_events() == []
    # Block 1 (the sequence's tail) is evicted next.
    (reused,) = pool.allocate(1)
    assert reused is blocks[1]
    assert reused.block_hash is None
    assert pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.take_events() == [BlockRemoved((hashes[1],))]


def test_touching_a_cached_free_block_pulls_it_from_the_middle_of_the_queue() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    hashes = _hashes(4)
    pool.cache_blocks(blocks, hashes, None)
    pool.free(blocks)  # queue: 0 1 2 3
    pool.touch([blocks[2]])  # a prefix hit on a free cached block
    assert blocks[2].ref_cnt == 1
    assert _ids(pool.free_queue) == [0, 1, 3]
    assert pool.num_free_blocks == 3
    evicted = pool.allocate(3)
    assert [b.block_id for b in evicted] == [0, 1, 3]
    assert pool.get_cached_block(hashes[2]) is blocks[2]  # survived: it was in use
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    # Touching a block that is already in use only adds a reference.
    pool.touch([blocks[2]])
    assert blocks[2].ref_cnt == 2
    assert pool.num_free_blocks == 0


def test_least_recently_freed_cached_block_is_evicted_first() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    ha, hb = _hashes(1, 0)[0], _hashes(1, 100)[0]
    pool.cache_blocks([a], [ha], None)
    pool.cache_blocks([b], [hb], None)
    pool.take_events()
    pool.free([b])
    pool.free([a])  # a was used more recently
    pool.allocate(1)
    assert pool.take_events() == [BlockRemoved((hb,))]
    assert pool.get_cached_block(ha) is a


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    hashes = _hashes(2)
    pool.cache_blocks(blocks, hashes, None)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.take_events() == []
    pool.free(blocks[1:])
    assert pool.reset_prefix_cache() is False  # one block is still in use
    pool.free(blocks[:1])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {}
    assert all(b.block_hash is None for b in blocks)
    assert pool.take_events() == [AllBlocksCleared()]
    # Evicting after a reset emits nothing: the index already dropped everything.
    pool.allocate(3)
    assert pool.take_events() == []


def test_pool_rejects_empty_size() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
