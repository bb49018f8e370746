"""The KV offload tiers: host LRU and byte bound, disk spill and file format, checksums, and
the block pool / KV manager's save-on-evict and restore-on-hit decisions, on a real (small)
CPU cache tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdmesh.engine.block_hash import BlockHash, HashScheme
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core.kv_block_file import (
    BlockFileError,
    BlockFileHeader,
    BlockLayout,
    decode_header,
    encode_header,
    read_block_file,
    write_block_file,
)
from pdmesh.engine.core.kv_offload import KVOffload
from pdmesh.engine.kv_events import (
    MEDIUM_DISK,
    MEDIUM_HOST,
    MEDIUM_PAGED,
    BlockRemoved,
    BlockStored,
)
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.scheduling.sequence import Sequence
from pdmesh.kvstore.transfer.checksum import ChecksumAlgo

pytestmark = pytest.mark.fast

BS = 4
LAYERS, HEADS, DIM = 2, 2, 8
SCHEME = HashScheme(block_size=BS)


def make_cache(num_blocks: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(LAYERS, 2, num_blocks, BS, HEADS, DIM, generator=g)


def block_bytes() -> int:
    return LAYERS * 2 * BS * HEADS * DIM * 4


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def make_seq(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=seq_id, index=0, token_ids=list(tokens),
                    num_prompt_tokens=len(tokens), params=SamplingParams())


# -- host tier -----------------------------------------------------------------------------
def test_host_tier_is_lru_and_bounded_in_bytes() -> None:
    cache = make_cache(4)
    tier = KVOffload(cache, host_bytes=2 * block_bytes() + block_bytes() // 2)
    assert tier.capacity == 2  # the half block left over holds nothing
    tier.save(0, h(0))
    tier.save(1, h(1))
    tier.save(0, h(0))  # held already: only marked recently used
    tier.save(2, h(2))  # evicts the least recently used: h(1)
    assert (tier.holds(h(0)), tier.holds(h(1)), tier.holds(h(2))) == (MEDIUM_HOST, None,
                                                                     MEDIUM_HOST)
    assert tier.take_events() == [BlockStored((h(0), h(1)), None, MEDIUM_HOST),
                                  BlockRemoved((h(1),), MEDIUM_HOST),
                                  BlockStored((h(2),), None, MEDIUM_HOST)]
    figures = tier.figures()
    assert (figures.host_blocks, figures.host_saved_blocks) == (2, 3)


def test_a_saved_block_restores_byte_for_byte_into_another_block() -> None:
    cache = make_cache(4)
    original = cache[:, :, 1].clone()
    tier = KVOffload(cache, host_bytes=4 * block_bytes())
    tier.save(1, h(1))
    cache[:, :, 1] = 0  # the block's next owner overwrites it
    assert tier.restore(h(1), 3)
    assert torch.equal(cache[:, :, 3], original)
    assert tier.figures().host_restored_blocks == 1


def test_a_host_block_failing_its_checksum_is_a_counted_miss() -> None:
    cache = make_cache(4)
    tier = KVOffload(cache, host_bytes=4 * block_bytes())
    tier.save(1, h(1))
    tier.take_events()
    tier.host[tier.entries[h(1)].slot, 1, 0, 0, 0, 0] += 1.0  # a flipped value in the tier
    before = cache[:, :, 2].clone()
    assert not tier.restore(h(1), 2)
    assert torch.equal(cache[:, :, 2], before)  # nothing was copied in
    assert tier.holds(h(1)) is None
    assert tier.figures().restore_failures == 1
    assert tier.take_events() == [BlockRemoved((h(1),), MEDIUM_HOST)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_tier_spills_to_disk_and_restores_from_it(tmp_path: Path,
                                                       dtype: torch.dtype) -> None:
    cache = make_cache(4).to(dtype)
    originals = [cache[:, :, i].clone() for i in range(3)]
    nbytes = block_bytes() // 4 * dtype.itemsize
    tier = KVOffload(cache, host_bytes=nbytes, disk_dir=str(tmp_path),
                     disk_bytes=2 * (nbytes + 128))
    tier.save(0, h(0))
    tier.save(1, h(1))  # h(0) spills to disk
    tier.save(2, h(2))  # h(1) spills; the disk tier is now full
    assert (tier.holds(h(0)), tier.holds(h(1)), tier.holds(h(2))) == (MEDIUM_DISK, MEDIUM_DISK,
                                                                     MEDIUM_HOST)
    assert len(list(tier.disk.dir.iterdir())) == 2
    cache.zero_()
    assert tier.restore(h(0), 3)
    assert torch.equal(cache[:, :, 3], originals[0])
    assert tier.restore(h(2), 0)
    assert torch.equal(cache[:, :, 0], originals[2])
    tier.save(3, h(3))  # h(2) spills; the disk's LRU file is h(1) (h(0) was just read)
    assert tier.holds(h(1)) is None and tier.holds(h(0)) == MEDIUM_DISK
    figures = tier.figures()
    assert (figures.disk_saved_blocks, figures.disk_restored_blocks,
            figures.host_restored_blocks) == (3, 1, 1)
    events = tier.take_events()
    assert BlockStored((h(0),), None, MEDIUM_DISK) in events
    assert BlockRemoved((h(1),), MEDIUM_DISK) in events
    directory = tier.disk.dir
    tier.close()
    assert not directory.exists() and tmp_path.exists()  # only its own directory goes


def test_a_corrupt_disk_block_is_a_counted_miss_and_its_file_goes(tmp_path: Path) -> None:
    cache = make_cache(4)
    tier = KVOffload(cache, host_bytes=block_bytes(), disk_dir=str(tmp_path),
                     disk_bytes=4 * (block_bytes() + 128))
    tier.save(0, h(0))
    tier.save(1, h(1))  # h(0) on disk
    path = tier.disk.path(h(0))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # one bit of the payload
    path.write_bytes(bytes(data))
    tier.take_events()
    assert not tier.restore(h(0), 2)
    assert not path.exists() and tier.holds(h(0)) is None
    assert tier.figures().restore_failures == 1
    assert tier.take_events() == [BlockRemoved((h(0),), MEDIUM_DISK)]


# -- the block file format -------------------------------------------------------------------
LAYOUT = BlockLayout("float32", LAYERS, BS, HEADS, DIM, 4)


def test_block_file_round_trip(tmp_path: Path) -> None:
    payload = torch.arange(LAYOUT.payload_bytes // 4, dtype=torch.float32)
    header = BlockFileHeader(ChecksumAlgo.XXH3_64, 0x1234_5678_9ABC_DEF0, h(7))
    path = tmp_path / "b.kvb"
    write_block_file(path, LAYOUT, header, memoryview(payload.numpy()).cast("B"))
    into = torch.zeros_like(payload)
    assert read_block_file(path, LAYOUT, h(7), memoryview(into.numpy()).cast("B")) == header
    assert torch.equal(into, payload)
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("change", ["magic", "version", "dtype", "shape", "hash", "truncated",
                                    "longer", "algo"])
def test_block_file_refuses_corrupt_or_foreign_files(tmp_path: Path, change: str) -> None:
    header = encode_header(LAYOUT, BlockFileHeader(ChecksumAlgo.XXH3_64, 1, h(7)))
    payload = bytes(LAYOUT.payload_bytes)
    data = bytearray(header + payload)
    layout, wanted = LAYOUT, h(7)
    if change == "magic":
        data[0:8] = b"NOTABLOK"
    elif change == "version":
        data[8] = 9
    elif change == "dtype":
        layout = BlockLayout("bfloat16", LAYERS, BS, HEADS, DIM, 2)
    elif change == "shape":
        layout = BlockLayout("float32", LAYERS + 1, BS, HEADS, DIM, 4)
    elif change == "hash":
        wanted = h(8)
    elif change == "truncated":
        data = data[:-1]
    elif change == "longer":
        data += b"\0"
    elif change == "algo":
        data[44] = 200
    path = tmp_path / "b.kvb"
    path.write_bytes(bytes(data))
    into = bytearray(layout.payload_bytes)
    with pytest.raises(BlockFileError):
        read_block_file(path, layout, wanted, memoryview(into))


def test_a_header_alone_decodes_only_against_its_own_layout() -> None:
    data = encode_header(LAYOUT, BlockFileHeader(ChecksumAlgo.CRC32, 5, h(3)))
    assert decode_header(data, LAYOUT, h(3)).checksum == 5
    with pytest.raises(BlockFileError):
        decode_header(data[:20], LAYOUT, h(3))


# -- the pool and the KV manager's decisions ----------------------------------------------------
def run_prompt(kv: KVCacheManager, cache: torch.Tensor, seq: Sequence) -> list[int]:
    """Admit `seq` as the scheduler does (prefix hits first) and 'compute' its other blocks
    by writing a value derived from each block's tokens; returns the hit count in blocks."""
    hits = kv.find_cached_prefix(seq)
    num_cached = len(hits) * BS
    assert kv.allocate_slots(seq, seq.num_tokens - num_cached, hits)
    for i, block_id in enumerate(kv.block_ids(seq.seq_id)):
        if i >= len(hits):
            cache[:, :, block_id] = float(sum(seq.token_ids[i * BS:(i + 1) * BS]))
    seq.num_computed_tokens = seq.num_tokens
    return [b.block_id for b in hits]


def test_evicted_prefixes_are_saved_and_a_later_hit_restores_them() -> None:
    cache = torch.zeros(LAYERS, 2, 4, BS, HEADS, DIM)
    tier = KVOffload(cache, host_bytes=8 * block_bytes())
    kv = KVCacheManager(4, SCHEME, tier=tier)
    a = make_seq("a", list(range(0, 13)))  # 3 full blocks + 1
    assert run_prompt(kv, cache, a) == []
    kv.free("a")
    kv.pool.take_events()
    b = make_seq("b", list(range(100, 113)))  # needs all 4 blocks: a's 3 cached ones go
    assert run_prompt(kv, cache, b) == []
    events = kv.pool.take_events()
    saved = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_HOST]
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_PAGED]
    a_hashes = kv._seq_hashes(a)[:3]
    assert sorted(x for e in saved for x in e.block_hashes) == sorted(a_hashes)
    assert sorted(x for e in removed for x in e.block_hashes) == sorted(a_hashes)
    kv.free("b")
    again = make_seq("again", [*range(0, 12), 999])  # a's 3 blocks, then new tokens
    hit_ids = run_prompt(kv, cache, again)
    assert len(hit_ids) == 3  # all three came back from the host tier
    assert kv.tier_restored_tokens == 3 * BS
    for i, block_id in enumerate(hit_ids):  # with a's bytes, not recomputed
        assert torch.all(cache[:, :, block_id] == float(sum(range(i * BS, (i + 1) * BS))))
    assert tier.figures().host_restored_blocks == 3
    restored = [e for e in kv.pool.take_events()
                if isinstance(e, BlockStored) and e.medium == MEDIUM_PAGED]
    assert [x for e in restored for x in e.block_hashes][:3] == a_hashes


def test_a_prefix_walk_mixes_paged_and_tier_hits_and_stops_at_a_miss() -> None:
    cache = torch.zeros(LAYERS, 2, 6, BS, HEADS, DIM)
    tier = KVOffload(cache, host_bytes=8 * block_bytes())
    kv = KVCacheManager(6, SCHEME, tier=tier)
    a = make_seq("a", list(range(0, 17)))  # 4 full blocks + 1
    run_prompt(kv, cache, a)
    kv.free("a")  # the queue: the unused block, a's partial block, then a's blocks 3, 2, 1, 0
    hashes = kv._seq_hashes(a)
    others = kv.pool.allocate(4)  # evicts (and saves) a's blocks 3 and 2
    kv.pool.free(others)
    assert [kv.pool.get_cached_block(x) is not None for x in hashes[:4]] == [True, True,
                                                                           False, False]
    assert [tier.holds(x) for x in hashes[2:4]] == [MEDIUM_HOST, MEDIUM_HOST]
    tier.host[tier.entries[hashes[3]].slot, 0, 0] += 1.0  # block 3's tier copy goes bad
    hits = kv.find_cached_prefix(make_seq("b", list(range(0, 17))))
    assert len(hits) == 3  # two paged hits, one restored, then block 3 fails its checksum
    assert [kv.pool.get_cached_block(x) is not None for x in hashes[:4]] == [True, True,
                                                                           True, False]
    assert tier.figures().restore_failures == 1
    assert kv.tier_restored_tokens == BS
    assert all(b.ref_cnt == 0 for b in hits)  # the walk's own references are returned


def test_no_free_block_means_no_restore() -> None:
    cache = torch.zeros(LAYERS, 2, 3, BS, HEADS, DIM)
    tier = KVOffload(cache, host_bytes=8 * block_bytes())
    kv = KVCacheManager(3, SCHEME, tier=tier)
    a = make_seq("a", list(range(0, 9)))
    run_prompt(kv, cache, a)
    kv.free("a")
    holder = make_seq("holder", list(range(50, 61)))  # takes all three blocks
    run_prompt(kv, cache, holder)
    assert all(tier.holds(x) == MEDIUM_HOST for x in kv._seq_hashes(a)[:2])
    assert kv.find_cached_prefix(make_seq("b", list(range(0, 9)))) == []
    assert kv.tier_restored_tokens == 0


def test_reset_prefix_cache_clears_the_tier_too() -> None:
    cache = make_cache(2)
    tier = KVOffload(cache, host_bytes=4 * block_bytes())
    kv = KVCacheManager(2, SCHEME, tier=tier)
    tier.save(0, h(1))
    assert kv.pool.reset_prefix_cache()
    assert tier.holds(h(1)) is None
    assert [type(e).__name__ for e in kv.pool.take_events()] == ["AllBlocksCleared"]


# -- configuration ---------------------------------------------------------------------------
def test_offload_flags_are_off_by_default_and_checked() -> None:
    assert EngineConfig().kv_offload_sizes() == (0, 0)
    assert EngineConfig(kv_offload_host_bytes="1MiB").kv_offload_sizes() == (2**20, 0)
    both = EngineConfig(kv_offload_host_bytes="1MiB", kv_offload_disk_dir="/tmp/x",
                        kv_offload_disk_bytes="2MiB")
    assert both.kv_offload_sizes() == (2**20, 2 * 2**20)
    with pytest.raises(ValueError, match="go together"):
        EngineConfig(kv_offload_host_bytes="1MiB", kv_offload_disk_dir="/tmp/x")
    with pytest.raises(ValueError, match="behind the host tier"):
        EngineConfig(kv_offload_disk_dir="/tmp/x", kv_offload_disk_bytes="2MiB")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_offload_host_bytes="1MiB", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(kv_offload_host_bytes="1MiB", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="no size"):
        EngineConfig(kv_offload_host_bytes="0.5")
    with pytest.raises(ValueError, match="hold no KV block"):
        KVOffload(make_cache(2), host_bytes=block_bytes() - 1)


# -- metrics ---------------------------------------------------------------------------------
def test_offload_metrics_appear_only_with_a_tier_and_count_by_medium() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pdmesh.metrics import EngineCollector, EngineState

    def scrape(**offload: int) -> dict[tuple[str, frozenset], float]:
        r = CollectorRegistry()
        r.register(EngineCollector("decode", lambda: EngineState(
            num_running=0, num_waiting=0, kv_usage=0.0, num_free_blocks=1, num_total_blocks=1,
            num_pinned_blocks=0, prefix_query_tokens=0, prefix_hit_tokens=0, index_up=None,
            **offload), model_name="smol"))
        text = generate_latest(r).decode()
        return {(s.name, frozenset(s.labels.items())): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    assert not [k for k in scrape() if "offload" in k[0]]
    got = scrape(kv_offload_block_bytes=100, kv_offload_host_blocks=5, kv_offload_disk_blocks=7,
                 kv_offload_host_saved_blocks=9, kv_offload_disk_saved_blocks=4,
                 kv_offload_host_restored_blocks=3, kv_offload_disk_restored_blocks=2,
                 kv_offload_restore_failures=1, kv_offload_restored_tokens=80)
    role = {("model_name", "smol"), ("role", "decode")}
    host, disk = frozenset({*role, ("medium", "host")}), frozenset({*role, ("medium", "disk")})
    assert got[("pdmesh:kv_offload_blocks", host)] == 5
    assert got[("pdmesh:kv_offload_blocks", disk)] == 7
    assert got[("pdmesh:kv_offload_saved_blocks_total", host)] == 9
    assert got[("pdmesh:kv_offload_saved_bytes_total", disk)] == 400
    assert got[("pdmesh:kv_offload_restored_blocks_total", host)] == 3
    assert got[("pdmesh:kv_offload_restored_bytes_total", disk)] == 200
    assert got[("pdmesh:kv_offload_restore_failures_total", frozenset(role))] == 1
    assert got[("pdmesh:kv_offload_prefill_tokens_saved_total", frozenset(role))] == 80


# -- the scheduler ----------------------------------------------------------------------------
def test_the_scheduler_counts_restored_blocks_as_cached_tokens() -> None:
    from pdmesh.engine.scheduling.scheduler import Scheduler, SchedulerConfig

    cache = torch.zeros(LAYERS, 2, 4, BS, HEADS, DIM)
    kv = KVCacheManager(4, SCHEME, tier=KVOffload(cache, host_bytes=8 * block_bytes()))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, max_model_len=16)

    def admit(seq: Sequence) -> int:
        sched.add(seq)
        (scheduled,) = sched.schedule().scheduled
        seq.num_computed_tokens += scheduled.num_new_tokens
        sched.finish(seq, seq.status)
        return scheduled.num_new_tokens

    assert admit(make_seq("a", list(range(0, 13)))) == 13
    assert admit(make_seq("b", list(range(50, 63)))) == 13  # evicts a's three blocks
    again = make_seq("again", [*range(0, 12), 7])
    assert admit(again) == 1  # only the new token: twelve came back from the tier
    assert again.num_cached_tokens == 12
    assert (kv.stats.queries, kv.stats.hits) == (39, 12)
    assert kv.tier_restored_tokens == 12
