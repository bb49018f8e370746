"""A tensor-parallel engine's caches as its KV connector sees them (kvstore/connector/
rank_caches.py): a block's canonical form and checksum do not depend on the layout, and a copy
between two layouts fills every destination rank with exactly its heads of the source blocks,
including replicated heads and uneven splits."""

from __future__ import annotations

import pytest
import torch

from pdmesh.engine.worker.parallel.sharding import ModelShard
from pdmesh.kvstore.connector.rank_caches import RankCaches, copy_across
from pdmesh.kvstore.transfer.checksum import ChecksumAlgo
from tests.unit.test_tp_sharding import Shape

pytestmark = pytest.mark.fast

SMALL = Shape(9, 3, 8, 64, 128)  # SmolLM2's head counts: 3 KV heads split 2 + 1
GROUPED = Shape(8, 2, 8, 64, 128)  # 2 KV heads: replicated at 4 ranks
LAYERS, BLOCKS, BLOCK_SIZE = 2, 10, 4


def whole(shape: Shape, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, BLOCKS, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim,
                       generator=generator)


def split_ranks(shape: Shape, full: torch.Tensor, world: int) -> RankCaches:
    spans = [ModelShard.of(shape, r, world).kv_heads for r in range(world)]
    return RankCaches(tuple(full[..., s.start:s.stop, :].contiguous() for s in spans), shape)


def empty_ranks(shape: Shape, world: int) -> RankCaches:
    return split_ranks(shape, torch.zeros_like(whole(shape)), world)


@pytest.mark.parametrize(("shape", "world"), [(SMALL, 1), (SMALL, 2), (SMALL, 3),
                                              (GROUPED, 4)])
def test_the_canonical_block_and_its_checksum_do_not_depend_on_the_layout(shape: Shape,
                                                                         world: int) -> None:
    full = whole(shape)
    ranks = split_ranks(shape, full, world)
    ids = [7, 2, 3]
    assert torch.equal(ranks.canonical(ids), full[:, :, ids])
    one = RankCaches((full,), shape)
    for algo in (ChecksumAlgo.XXH64, ChecksumAlgo.CRC32, ChecksumAlgo.LIN64):
        assert ranks.checksums(algo, ids) == one.checksums(algo, ids)
    assert ranks.layout == (LAYERS, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)


@pytest.mark.parametrize(("shape", "src_world", "dst_world"), [
    (SMALL, 1, 1), (SMALL, 2, 1), (SMALL, 1, 2), (SMALL, 2, 2), (SMALL, 3, 2), (SMALL, 2, 3),
    (GROUPED, 4, 1), (GROUPED, 1, 4), (GROUPED, 4, 2)])
def test_a_copy_between_layouts_lands_each_ranks_heads(shape: Shape, src_world: int,
                                                       dst_world: int) -> None:
    full = whole(shape)
    src = split_ranks(shape, full, src_world)
    dst = empty_ranks(shape, dst_world)
    src_ids, dst_ids = [1, 2, 3, 8], [4, 5, 0, 9]
    sums = copy_across(ChecksumAlgo.XXH64, dst, dst_ids, src, src_ids)
    expected = torch.zeros_like(full)
    expected[:, :, dst_ids] = full[:, :, src_ids]
    want = split_ranks(shape, expected, dst_world)
    for got, cache in zip(dst.caches, want.caches, strict=True):
        assert torch.equal(got, cache)  # the blocks landed, nothing else was written
    assert sums == src.checksums(ChecksumAlgo.XXH64, src_ids)


def test_a_rank_cache_without_its_heads_is_refused() -> None:
    full = whole(SMALL)
    with pytest.raises(ValueError, match="rank 1"):
        RankCaches((full[..., :2, :], full[..., :2, :]), SMALL)
    with pytest.raises(ValueError, match="shape"):
        RankCaches((full, full))


@pytest.mark.parametrize(("shape", "world"), [(SMALL, 2), (SMALL, 3), (GROUPED, 4)])
def test_pieces_read_canonical_and_write_back_into_every_rank(shape: Shape, world: int) -> None:
    """What a block server sends of a tensor-parallel cache (one (layer, K/V) piece of a run
    of blocks at a time) is the canonical piece; what a pull receives lands in every rank."""
    full = whole(shape)
    ranks = split_ranks(shape, full, world)
    out = torch.empty(3, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    ranks.read_piece(1, 0, 4, out)
    assert torch.equal(out, full[1, 0, 4:7])
    target = empty_ranks(shape, world)
    target.write_piece(1, 0, 4, out)
    expected = torch.zeros_like(full)
    expected[1, 0, 4:7] = full[1, 0, 4:7]
    for got, cache in zip(target.caches, split_ranks(shape, expected, world).caches,
                          strict=True):
        assert torch.equal(got, cache)
    assert ranks.block_nbytes == full[:, :, 0].numel() * full.element_size()


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="needs two CUDA devices (a rank on each)")


@two_gpus
def test_a_copy_into_ranks_on_two_devices_waits_for_the_step_in_flight() -> None:
    """A landing block that a step still in flight writes on rank 1's device (a request's last
    step, async scheduling): the pull's copies into rank 1 must come after it. Rank 0's model
    stream stands for the step's end (it waits for rank 1, as its last collective does); the
    pull runs on its receiving stream, as `KVConnector` runs it."""
    from pdmesh.kvstore.connector.blocks import receiving_stream

    full = whole(SMALL)
    src = split_ranks(SMALL, full, 1)
    zeros = split_ranks(SMALL, torch.zeros_like(full), 2)
    dst = RankCaches((zeros.caches[0].to("cuda:0"), zeros.caches[1].to("cuda:1")), SMALL)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    rank1 = torch.cuda.Stream("cuda:1")
    model = torch.cuda.Stream("cuda:0")
    with torch.cuda.stream(rank1):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of the step still running on rank 1
        dst.caches[1][:, :, 4].fill_(7.0)  # it writes the block the pull lands in
    model.wait_stream(rank1)  # rank 0's step ends after rank 1's (the last collective)
    with torch.cuda.device("cuda:0"), receiving_stream(dst.first, model):
        copy_across(ChecksumAlgo.XXH64, dst, [4], src, [1])
    want = split_ranks(SMALL, full[:, :, [1]].contiguous(), 2)
    assert torch.equal(dst.caches[1][:, :, 4].cpu(), want.caches[1][:, :, 0])
    assert torch.equal(dst.caches[0][:, :, 4].cpu(), want.caches[0][:, :, 0])
