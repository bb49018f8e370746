"""The plan that moves KV heads between tensor-parallel layouts (P/D at different TP): equal
TP rank to rank, prefill TP > decode TP gathering, prefill TP < decode TP splitting, replicated
heads read once; applied to tensors it rebuilds exactly each destination rank's heads."""

from __future__ import annotations

import pytest
import torch

from pdmesh.engine.worker.parallel.kv_layout import HeadCopy, assemble, kv_head_plan
from pdmesh.engine.worker.parallel.sharding import ModelShard, Span
from tests.unit.test_tp_sharding import LLAMA_8B, SMOLLM2, Shape

pytestmark = pytest.mark.fast


def test_equal_layouts_copy_rank_to_rank() -> None:
    assert kv_head_plan(LLAMA_8B, 4, 4) == [
        HeadCopy(r, r, Span(2 * r, 2), 0, 0) for r in range(4)]


def test_prefill_at_two_ranks_decode_at_one_gathers() -> None:
    assert kv_head_plan(SMOLLM2, 2, 1) == [HeadCopy(0, 0, Span(0, 2), 0, 0),
                                           HeadCopy(1, 0, Span(2, 1), 0, 2)]


def test_prefill_at_one_rank_decode_at_two_splits() -> None:
    assert kv_head_plan(SMOLLM2, 1, 2) == [HeadCopy(0, 0, Span(0, 2), 0, 0),
                                           HeadCopy(0, 1, Span(2, 1), 2, 0)]


def test_replicated_heads_are_read_from_one_replica_each() -> None:
    plan = kv_head_plan(LLAMA_8B, 16, 8)  # 8 KV heads: each on two source ranks
    assert [(c.src_rank, c.dst_rank, c.heads) for c in plan] == [
        (2 * h + h % 2, h, Span(h, 1)) for h in range(8)]


@pytest.mark.parametrize(("shape", "src", "dst"), [
    (SMOLLM2, 1, 3), (SMOLLM2, 3, 2), (SMOLLM2, 2, 3), (LLAMA_8B, 3, 8), (LLAMA_8B, 16, 3),
    (LLAMA_8B, 2, 32), (Shape(32, 4, 8, 64, 128), 8, 2)])
def test_the_plan_rebuilds_every_destination_ranks_heads(shape: Shape, src: int,
                                                         dst: int) -> None:
    full = torch.randn(3, 2, shape.num_kv_heads, 4)  # [blocks, K/V, heads, head_dim]
    def slices(world: int) -> list[torch.Tensor]:
        spans = [ModelShard.of(shape, r, world).kv_heads for r in range(world)]
        return [full[..., s.start:s.stop, :] for s in spans]
    plan = kv_head_plan(shape, src, dst)
    for rank, expected in enumerate(slices(dst)):
        assert torch.equal(assemble(plan, slices(src), rank, expected.shape[-2]), expected)
