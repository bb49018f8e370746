"""Tensor-parallel sharding arithmetic: which heads, MLP columns and vocabulary rows each rank
holds and reads of the checkpoint; KV head replication; the sizes a model refuses; the threads
per rank; and the step channel's tensors between two in-process gloo ranks."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.worker.cpu_threads import rank_threads
from pdmesh.engine.worker.input_batch import StepInputs
from pdmesh.engine.worker.parallel.group import COLLECTIVE_TIMEOUT, TensorParallel, join_group
from pdmesh.engine.worker.parallel.sharding import (
    ModelShard,
    Span,
    check_shardable,
    sizes_for,
    split,
    widths,
)
from pdmesh.engine.worker.parallel.step_channel import Op, StepChannel
from pdmesh.kernels.backend import AttentionMetadata

pytestmark = pytest.mark.fast


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0


SMOLLM2 = Shape(9, 3, 64, 1536, 49152)
LLAMA_8B = Shape(32, 8, 128, 14336, 128256)
QWEN2_MOE = Shape(16, 16, 128, 5632, 151936, 1408, 5632)  # Qwen1.5-MoE-A2.7B


def shards(shape: Shape, world: int) -> list[ModelShard]:
    return [ModelShard.of(shape, r, world) for r in range(world)]


def test_split_is_contiguous_and_as_even_as_it_can_be() -> None:
    assert [split(3, 2, r) for r in range(2)] == [Span(0, 2), Span(2, 1)]
    assert widths(10, 4) == [3, 3, 2, 2]
    for total, parts in [(9, 2), (128256, 3), (7, 7)]:
        spans = [split(total, parts, r) for r in range(parts)]
        assert spans[0].start == 0 and spans[-1].stop == total
        assert all(a.stop == b.start for a, b in itertools.pairwise(spans))


@pytest.mark.parametrize(("shape", "world"), [(SMOLLM2, 2), (SMOLLM2, 3), (LLAMA_8B, 4),
                                              (LLAMA_8B, 3), (LLAMA_8B, 16), (LLAMA_8B, 32)])
def test_every_query_head_once_beside_its_kv_head(shape: Shape, world: int) -> None:
    group = shape.num_heads // shape.num_kv_heads
    seen: list[int] = []
    for shard in shards(shape, world):
        q = range(shard.q_heads.start, shard.q_heads.stop)
        seen += q
        # A rank's query heads read only the KV heads it holds: attention stays local.
        assert {h // group for h in q} <= set(range(shard.kv_heads.start, shard.kv_heads.stop))
        assert shard.q_heads.size > 0 and shard.kv_heads.size > 0
    assert seen == list(range(shape.num_heads))
    assert sum(s.intermediate.size for s in shards(shape, world)) == shape.intermediate_size
    assert sum(s.vocab.size for s in shards(shape, world)) == shape.vocab_size


def test_uneven_kv_heads_the_first_rank_holds_one_more() -> None:
    first, second = shards(SMOLLM2, 2)
    assert (first.kv_heads, first.q_heads) == (Span(0, 2), Span(0, 6))
    assert (second.kv_heads, second.q_heads) == (Span(2, 1), Span(6, 3))
    assert first.vocab_widths == (24576, 24576)


def test_fewer_kv_heads_than_ranks_replicates_them() -> None:
    by_rank = shards(LLAMA_8B, 16)  # 8 KV heads, 2 ranks each
    assert [s.kv_heads.start for s in by_rank] == [r // 2 for r in range(16)]
    assert [s.q_heads for s in by_rank[:3]] == [Span(0, 2), Span(2, 2), Span(4, 2)]


def test_a_size_that_cannot_split_the_model_is_refused_naming_the_sizes_that_can() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=12 .* 8 KV heads and 32 query"):
        check_shardable(LLAMA_8B, 12)
    with pytest.raises(ValueError, match="sizes that fit: 1, 2, 3, 9"):
        check_shardable(SMOLLM2, 6)
    assert sizes_for(LLAMA_8B) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32]


def test_checkpoint_slices_rows_of_column_parallel_and_columns_of_row_parallel() -> None:
    shard = ModelShard.of(SMOLLM2, 1, 2)
    layer = "layers.4."
    assert shard.checkpoint_slice(layer + "self_attn.q_proj.weight") == (0, Span(384, 192))
    assert shard.checkpoint_slice(layer + "self_attn.q_proj.bias") == (0, Span(384, 192))
    assert shard.checkpoint_slice(layer + "self_attn.k_proj.weight") == (0, Span(128, 64))
    assert shard.checkpoint_slice(layer + "self_attn.v_proj.bias") == (0, Span(128, 64))
    assert shard.checkpoint_slice(layer + "self_attn.o_proj.weight") == (1, Span(384, 192))
    assert shard.checkpoint_slice(layer + "mlp.gate_proj.weight") == (0, Span(768, 768))
    assert shard.checkpoint_slice(layer + "mlp.down_proj.weight") == (1, Span(768, 768))
    assert shard.checkpoint_slice("embed_tokens.weight") == (0, Span(24576, 24576))
    assert shard.checkpoint_slice("lm_head.weight") == (0, Span(24576, 24576))
    assert shard.checkpoint_slice(layer + "input_layernorm.weight") is None
    assert shard.checkpoint_slice("norm.weight") is None
    # A row-parallel bias is added once, after the all-reduce.
    assert shard.checkpoint_slice(layer + "mlp.down_proj.bias") is None
    assert not shard.keeps_whole_bias(layer + "mlp.down_proj.bias")
    assert ModelShard.of(SMOLLM2, 0, 2).keeps_whole_bias(layer + "mlp.down_proj.bias")


def test_experts_and_the_shared_expert_split_by_their_own_columns() -> None:
    shard = ModelShard.of(QWEN2_MOE, 1, 4)
    layer = "layers.2.mlp."
    assert shard.checkpoint_slice(layer + "experts.7.gate_proj.weight") == (0, Span(352, 352))
    assert shard.checkpoint_slice(layer + "experts.7.up_proj.weight") == (0, Span(352, 352))
    assert shard.checkpoint_slice(layer + "experts.0.down_proj.weight") == (1, Span(352, 352))
    assert shard.checkpoint_slice(layer + "shared_expert.up_proj.weight") == (0, Span(1408, 1408))
    assert shard.checkpoint_slice(layer + "shared_expert.down_proj.weight") == (1,
                                                                                Span(1408, 1408))
    assert shard.checkpoint_slice(layer + "gate.weight") is None  # the router: every rank
    assert shard.checkpoint_slice(layer + "shared_expert_gate.weight") is None
    assert shard.checkpoint_slice("layers.2.mlp.gate_proj.weight") == (0, Span(1408, 1408))
    assert ModelShard.of(SMOLLM2, 0, 2).moe_intermediate == Span(0, 0)  # a dense model
    with pytest.raises(ValueError, match="expert"):
        check_shardable(Shape(16, 16, 128, 5632, 151936, 8), 16)


def test_threads_are_split_over_the_ranks() -> None:
    assert rank_threads(None, "cpu", 2, 2) == 1
    assert rank_threads(8, "cpu", 2, 2) == 4
    assert rank_threads(3, "cpu", 2, 2) == 1
    assert rank_threads(None, "cuda", 16, 4) == 1
    assert rank_threads(6, "cpu", 2, 1) == 6
    assert rank_threads(None, "cpu", 2, 1) is None


def test_the_flag_is_validated() -> None:
    assert EngineConfig().tensor_parallel_size == 1
    for bad in (0, -1):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            EngineConfig(tensor_parallel_size=bad)


def _pair(tmp_path: Path, body0, body1) -> list[object]:  # type: ignore[no-untyped-def]
    """Run `body0(tp)` and `body1(tp)` as ranks 0 and 1 of a gloo group, on two threads."""
    results: list[object] = [None, None]

    def rank(r: int, body) -> None:  # type: ignore[no-untyped-def]
        tp = join_group(str(tmp_path / "store"), r, 2, torch.device("cpu"), join_timeout_s=30)
        try:
            results[r] = body(tp)
        except Exception as exc:
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r, b)) for r, b in enumerate((body0, body1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _step() -> StepInputs:
    t = torch.tensor
    meta = AttentionMetadata(
        slot_mapping=t([33, 70, 71, 72]), num_decode_tokens=1,
        decode_block_tables=t([[2, 0]]), decode_seq_lens=t([2]),
        prefill_query_start_loc=[0, 3], prefill_seq_lens=[3],
        prefill_block_tables=t([[4, 5]]))
    return StepInputs(input_ids=t([5, 6, 7, 8]), positions=t([1, 0, 1, 2]), meta=meta,
                      order=[], row_start=[0, 1], logits_rows=[0, 3],
                      sample_index={"a": 0, "b": 1}, prompt_logits={})


def test_the_step_channel_carries_a_step_and_block_copies(tmp_path: Path) -> None:
    def send(tp: TensorParallel) -> None:
        channel = StepChannel(tp, torch.device("cpu"))
        channel.send_step(_step())
        channel.send_copies([(3, 9), (4, 10)])
        channel.send_stop()

    def receive(tp: TensorParallel) -> list[object]:
        channel = StepChannel(tp, torch.device("cpu"))
        return [channel.receive() for _ in range(3)]

    _, got = _pair(tmp_path, send, receive)
    assert isinstance(got, list), got
    step, copies, stop = got
    sent = _step()
    assert step.op is Op.STEP and step.inputs is not None
    inputs, meta = step.inputs, step.inputs.meta
    assert inputs.input_ids.tolist() == sent.input_ids.tolist()
    assert inputs.positions.tolist() == sent.positions.tolist()
    assert inputs.logits_rows == [0, 3]
    assert meta.slot_mapping.tolist() == [33, 70, 71, 72]
    assert meta.num_decode_tokens == 1 and meta.decode_block_tables.tolist() == [[2, 0]]
    assert meta.decode_seq_lens.tolist() == [2]
    assert (meta.prefill_query_start_loc, meta.prefill_seq_lens) == ([0, 3], [3])
    assert meta.prefill_block_tables.tolist() == [[4, 5]]
    assert copies.op is Op.COPY and copies.copies == [(3, 9), (4, 10)]
    assert stop.op is Op.STOP


def test_a_header_that_does_not_add_up_is_refused(tmp_path: Path) -> None:
    def send(tp: TensorParallel) -> None:
        tp.broadcast_host(torch.tensor([int(Op.STEP), 5, 4, 1, 1, 2, 2, 2]))  # lays out 23
        tp.broadcast(torch.zeros(5, dtype=torch.int64))

    def receive(tp: TensorParallel) -> object:
        return StepChannel(tp, torch.device("cpu")).receive()

    _, got = _pair(tmp_path, send, receive)
    assert isinstance(got, ValueError) and "does not lay out 5 values" in str(got)


def test_headers_go_over_the_control_group_beside_the_payloads_group(tmp_path: Path) -> None:
    """On CUDA the ranks' group is NCCL, and the step channel's headers go over a gloo group
    beside it (an idle rank then waits asleep, not in a spinning NCCL kernel); two real gloo
    groups here, the second as the control group: a step and a stop cross in order."""
    from torch import distributed as dist

    from pdmesh.engine.worker.parallel.group import _gloo_group

    def join(r: int) -> TensorParallel:
        store = dist.FileStore(str(tmp_path / "pair"), 2)
        group = _gloo_group(dist.PrefixStore("group", store), r, 2)
        return TensorParallel(r, 2, group, _gloo_group(dist.PrefixStore("control", store), r, 2))

    results: list[object] = [None, None]

    def rank(r: int) -> None:
        tp = join(r)
        channel = StepChannel(tp, torch.device("cpu"))
        if r == 0:
            channel.send_step(_step())
            channel.send_stop()
            results[r] = True
        else:
            results[r] = [channel.receive().op for _ in range(2)]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [True, [Op.STEP, Op.STOP]]
    assert _pair(tmp_path, lambda tp: tp.control, lambda tp: tp.control) == [None, None]


def test_joining_stops_when_a_rank_that_has_not_joined_is_gone(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="exited before it joined"):
        join_group(str(tmp_path / "store"), 0, 2, torch.device("cpu"), alive=lambda: False)
    with pytest.raises(RuntimeError, match="did not all join within 1 s"):
        join_group(str(tmp_path / "store2"), 0, 2, torch.device("cpu"), join_timeout_s=1)


def test_each_rank_gets_its_share_of_the_engines_threads_and_needs_one() -> None:
    from pdmesh.engine.core.ranks import rank_config, rank_device

    config = EngineConfig(device="cpu", tensor_parallel_size=2, cpu_threads=4)
    assert rank_config(config).cpu_threads == 2
    with pytest.raises(ValueError, match="tensor_parallel_size=4 exceeds the engine's 2 CPU"):
        rank_config(EngineConfig(device="cpu", tensor_parallel_size=4, cpu_threads=2))
    assert rank_device(torch.device("cpu"), 1, 2) == "cpu"
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="needs 2 CUDA devices"):
            rank_device(torch.device("cuda", 0), 1, 2)


def test_collectives_do_not_time_out_while_an_engine_idles(tmp_path: Path) -> None:
    """An idle engine's ranks wait in the next step's broadcast; with gloo's default timeout
    (or any short one) they failed after that long idle. A dead rank is found by its process."""
    timeouts = _pair(tmp_path, lambda tp: tp.group.options._timeout,
                     lambda tp: tp.group.options._timeout)
    assert timeouts == [COLLECTIVE_TIMEOUT, COLLECTIVE_TIMEOUT]
    assert timedelta(days=30) <= COLLECTIVE_TIMEOUT
