"""KVCacheManager: prefix hits, allocation, forks and frees, checked against the block pool."""

from __future__ import annotations

import pytest

from pdmesh.engine.block_hash import HashScheme, hash_token_blocks
from pdmesh.engine.kv_events import BlockRemoved, BlockStored
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager, PrefixCacheStats
from pdmesh.engine.scheduling.sequence import Sequence

pytestmark = pytest.mark.fast

BS = 4
SCHEME = HashScheme(block_size=BS)
PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks + 2


def make_seq(
    seq_id: str,
    tokens: list[int],
    *,
    salt: str | None = None,
    params: SamplingParams | None = None,
) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=seq_id,
        index=0,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        params=params or SamplingParams(),
        cache_salt=salt,
    )


def compute(kv: KVCacheManager, seq: Sequence, num_new: int | None = None) -> None:
    """Schedule and 'run' the next `num_new` tokens of `seq` (all uncomputed by default)."""
    num_new = seq.num_uncomputed_tokens if num_new is None else num_new
    assert kv.allocate_slots(seq, num_new)
    seq.num_computed_tokens += num_new


def admit(kv: KVCacheManager, seq: Sequence) -> int:
    """Admit `seq` the way the scheduler does; returns the number of prefix-hit tokens."""
    hits = kv.find_cached_prefix(seq)
    num_cached = len(hits) * BS
    assert kv.allocate_slots(seq, seq.num_tokens - num_cached, hits)
    seq.num_computed_tokens = seq.num_tokens
    return num_cached


def snapshot(kv: KVCacheManager) -> tuple[object, ...]:
    pool = kv.pool
    return (
        pool.num_free_blocks,
        [b.block_id for b in pool.free_queue],
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        dict(pool.cached),
    )


@pytest.fixture(name="kv")
def kv_fixture() -> KVCacheManager:
    return KVCacheManager(num_blocks=8, scheme=SCHEME)


# -- prefix hits --------------------------------------------------------------------------------


def test_prefix_hit_is_the_longest_cached_run_leaving_a_token_to_compute(
    kv: KVCacheManager,
) -> None:
    owner = make_seq("owner", PROMPT)
    compute(kv, owner)
    owner_ids = kv.block_ids("owner")

    same = make_seq("same", PROMPT)
    assert [b.block_id for b in kv.find_cached_prefix(same)] == owner_ids[:2]
    longer = make_seq("longer", [*PROMPT, 7, 7, 7])
    assert [b.block_id for b in kv.find_cached_prefix(longer)] == owner_ids[:2]
    one_over = make_seq("one-over", PROMPT[:9])
    assert len(kv.find_cached_prefix(one_over)) == 2
    # Block-aligned prompt fully cached: the last block is recomputed for its logits.
    aligned = make_seq("aligned", PROMPT[:8])
    assert [b.block_id for b in kv.find_cached_prefix(aligned)] == owner_ids[:1]
    single_block = make_seq("single", PROMPT[:4])
    assert kv.find_cached_prefix(single_block) == []
    diverged = make_seq("diverged", [*PROMPT[:5], 0, *PROMPT[6:]])
    assert [b.block_id for b in kv.find_cached_prefix(diverged)] == owner_ids[:1]
    assert kv.find_cached_prefix(make_seq("other", [1, *PROMPT[1:]])) == []
    # Looking up takes no references.
    assert [kv.pool.blocks[i].ref_cnt for i in owner_ids] == [1, 1, 1]


def test_cache_salt_isolates_prefixes(kv: KVCacheManager) -> None:
    compute(kv, make_seq("owner", PROMPT, salt="tenant-a"))
    assert len(kv.find_cached_prefix(make_seq("same-tenant", PROMPT, salt="tenant-a"))) == 2
    assert kv.find_cached_prefix(make_seq("other-tenant", PROMPT, salt="tenant-b")) == []
    assert kv.find_cached_prefix(make_seq("no-tenant", PROMPT)) == []


def test_prompt_logprobs_and_disabled_caching_skip_prefix_hits(kv: KVCacheManager) -> None:
    compute(kv, make_seq("owner", PROMPT))
    wants_logprobs = make_seq("lp", PROMPT, params=SamplingParams(prompt_logprobs=0))
    assert kv.find_cached_prefix(wants_logprobs) == []

    off = KVCacheManager(num_blocks=8, scheme=SCHEME, enable_prefix_caching=False)
    compute(off, make_seq("owner", PROMPT))
    assert off.find_cached_prefix(make_seq("same", PROMPT)) == []
    assert off.pool.cached == {}
    assert off.pool.take_events() == []


def test_prefix_hit_stops_at_the_first_evicted_block(kv: KVCacheManager) -> None:
    owner = make_seq("owner", [*PROMPT, 1, 2, 3])  # 13 tokens: 3 full blocks + 1
    compute(kv, owner)
    blocks = [kv.pool.blocks[i] for i in kv.block_ids("owner")]
    hashes = [b.block_hash for b in blocks[:3]]
    kv.free("owner")
    kv.pool.touch([blocks[2]])  # keep block 2 out of the eviction queue
    while kv.pool.get_cached_block(hashes[1]) is not None:
        kv.pool.allocate(1)
    assert kv.pool.get_cached_block(hashes[0]) is blocks[0]
    assert kv.pool.get_cached_block(hashes[2]) is blocks[2]
    hits = kv.find_cached_prefix(make_seq("again", [*PROMPT, 1, 2, 3]))
    assert hits == [blocks[0]]


def test_hits_on_running_and_on_free_cached_blocks(kv: KVCacheManager) -> None:
    owner = make_seq("owner", PROMPT)
    compute(kv, owner)
    assert kv.num_free_blocks == 5

    # The owner is still running: hits share its blocks and add a reference.
    sharer = make_seq("sharer", PROMPT)
    assert admit(kv, sharer) == 8
    assert kv.block_ids("sharer")[:2] == kv.block_ids("owner")[:2]
    assert kv.block_ids("sharer")[2] != kv.block_ids("owner")[2]
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_ids("owner")] == [2, 2, 1]
    assert kv.num_free_blocks == 4

    # Both gone: the full blocks stay findable, and a later hit takes them back from the queue.
    kv.free("owner")
    kv.free("sharer")
    assert kv.num_free_blocks == 8
    late = make_seq("late", PROMPT)
    assert admit(kv, late) == 8
    assert kv.num_free_blocks == 5  # 2 hits pulled from the free queue + 1 new block
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in kv.block_ids("late"))


def test_prefix_cache_counters_are_in_tokens() -> None:
    stats = PrefixCacheStats()
    assert stats.hit_rate == 0.0
    kv = KVCacheManager(num_blocks=8, scheme=SCHEME)
    kv.record_prefix_query(num_prompt_tokens=10, num_hit_tokens=0)
    kv.record_prefix_query(num_prompt_tokens=10, num_hit_tokens=8)
    kv.record_prefix_query(num_prompt_tokens=12, num_hit_tokens=4)
    assert (kv.stats.queries, kv.stats.hits) == (32, 12)
    assert kv.stats.hit_rate == pytest.approx(12 / 32)


# -- allocation ---------------------------------------------------------------------------------


def test_allocation_grows_one_block_at_a_time_and_caches_full_blocks(
    kv: KVCacheManager,
) -> None:
    seq = make_seq("s", PROMPT[:6])
    hashes = hash_token_blocks(SCHEME, PROMPT)
    assert kv.allocate_slots(seq, 3)  # a first chunk: no full block yet
    assert len(kv.block_ids("s")) == 1
    assert kv.pool.take_events() == []
    seq.num_computed_tokens = 3
    assert kv.allocate_slots(seq, 3)  # the chunk that fills block 0
    seq.num_computed_tokens = 6
    assert len(kv.block_ids("s")) == 2
    assert kv.pool.take_events() == [BlockStored((hashes[0],), None)]
    # Decode: tokens 6 and 7 fit in block 1; the step that computes token 7 fills it.
    seq.token_ids.append(PROMPT[6])
    assert kv.allocate_slots(seq, 1)
    seq.num_computed_tokens = 7
    assert kv.pool.take_events() == []
    seq.token_ids.append(PROMPT[7])
    assert kv.allocate_slots(seq, 1)
    seq.num_computed_tokens = 8
    assert len(kv.block_ids("s")) == 2
    assert kv.pool.take_events() == [BlockStored((hashes[1],), hashes[0])]
    seq.token_ids.append(PROMPT[8])
    assert kv.allocate_slots(seq, 1)
    assert len(kv.block_ids("s")) == 3
    assert kv.num_blocks_for(9) == 3


def test_allocation_failure_leaves_state_unchanged(kv: KVCacheManager) -> None:
    compute(kv, make_seq("owner", PROMPT))  # 3 blocks, 2 cached
    kv.free("owner")  # all free, 2 findable
    filler = make_seq("filler", list(range(500, 516)))
    compute(kv, filler)  # 4 of the 8 blocks
    kv.pool.take_events()
    before = snapshot(kv)

    # Needs 2 hit blocks (free, so they count against free space) + 3 new blocks: 5 > 4.
    big = make_seq("big", [*PROMPT, *range(10)])
    hits = kv.find_cached_prefix(big)
    assert len(hits) == 2
    assert not kv.allocate_slots(big, big.num_tokens - 2 * BS, hits)
    assert snapshot(kv) == before
    assert not kv.has_blocks("big")
    assert kv.block_ids("big") == []
    assert kv.pool.take_events() == []

    assert not kv.allocate_slots(make_seq("huge", list(range(40))), 40)
    assert not kv.has_blocks("huge")
    assert snapshot(kv) == before

    # A running sequence that cannot grow keeps exactly what it had.
    filler_ids = kv.block_ids("filler")
    filler.token_ids += list(range(20))
    assert not kv.allocate_slots(filler, 20)  # needs 5 more blocks, 4 are free
    assert kv.block_ids("filler") == filler_ids
    assert snapshot(kv) == before

    # With exactly enough room the same request succeeds.
    kv.free("filler")
    assert kv.allocate_slots(big, big.num_tokens - 2 * BS, hits)
    assert kv.num_free_blocks == 3


# -- fork ---------------------------------------------------------------------------------------


def test_fork_shares_full_blocks_and_copies_the_partial_block(kv: KVCacheManager) -> None:
    parent = make_seq("parent", PROMPT)  # 10 computed tokens: 2 full blocks + a partial one
    compute(kv, parent)
    child = make_seq("child", PROMPT)
    free_before = kv.num_free_blocks
    parent_ids = kv.block_ids("parent")

    copy = kv.fork(parent, child)

    child_ids = kv.block_ids("child")
    assert copy == (parent_ids[2], child_ids[2])
    assert child_ids[:2] == parent_ids[:2]
    assert child_ids[2] not in parent_ids
    assert kv.num_free_blocks == free_before - 1
    refs = [kv.pool.blocks[i].ref_cnt for i in (*parent_ids, child_ids[2])]
    assert refs == [2, 2, 1, 1]

    # Both grow independently from here (copy-on-write of the partial block already happened).
    child.num_computed_tokens = parent.num_computed_tokens
    for seq, token in ((parent, 1), (child, 2)):
        seq.token_ids.append(token)
        compute(kv, seq)
    assert kv.block_ids("parent") == parent_ids
    assert kv.block_ids("child") == child_ids

    kv.free("parent")
    kv.free("child")
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_fork_of_block_aligned_sequence_copies_nothing(kv: KVCacheManager) -> None:
    parent = make_seq("parent", PROMPT[:8])
    compute(kv, parent)
    child = make_seq("child", PROMPT[:8])
    assert kv.fork(parent, child) is None
    assert kv.block_ids("child") == kv.block_ids("parent")
    assert kv.num_free_blocks == 6


def test_fork_without_a_free_block_raises_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, scheme=SCHEME)
    parent = make_seq("parent", PROMPT)
    compute(kv, parent)
    before = snapshot(kv)
    with pytest.raises(RuntimeError, match="no free block"):
        kv.fork(parent, make_seq("child", PROMPT))
    assert snapshot(kv) == before
    assert not kv.has_blocks("child")


# -- free ---------------------------------------------------------------------------------------


def test_free_returns_every_block_tail_first(kv: KVCacheManager) -> None:
    a = make_seq("a", PROMPT)
    b = make_seq("b", PROMPT)
    compute(kv, a)
    admit(kv, b)
    kv.pool.take_events()
    a_ids = kv.block_ids("a")
    kv.free("a")
    assert kv.num_free_blocks == 5  # only a's own tail block: the shared ones are b's too
    kv.free("b")
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not kv.has_blocks("a") and not kv.has_blocks("b")
    assert kv.usage == 0.0
    kv.free("b")  # freeing an unknown or freed sequence is harmless
    # Full blocks stay findable; eviction takes the never-used blocks, then the tails.
    assert len(kv.find_cached_prefix(make_seq("again", PROMPT))) == 2
    kv.pool.allocate(kv.pool.num_blocks - 2)
    removed = [e for e in kv.pool.take_events() if isinstance(e, BlockRemoved)]
    assert removed == []
    assert [b.block_id for b in kv.pool.free_queue] == a_ids[1::-1]
