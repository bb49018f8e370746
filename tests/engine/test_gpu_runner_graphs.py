"""CUDA graphs of decode steps: how they are planned, and what happens when capture fails.

- The plan (CPU, pure functions): the block table is as wide as `max_model_len` needs, the
  split count fills the device's SMs for the bucket's rows, and buckets that need several
  splits get graphs over narrower tables so a short context runs a short serial chain
  (issue 24, item 9: batch 1 at 768 tokens ran 8 programs of 48 blocks, now 48 of 8).
- The fallback (CPU): a DecodeGraphs whose capture fails part-way leaves the runner eager,
  its graphs released, the reason on `graphs_disabled_reason`, one WARNING in the log, and
  outputs identical to a runner that never had graphs (issue 24, item 5).
- The narrow-table replay path (CPU, Triton's interpreter): graphs planned over a narrow and a
  full table, replayed by eager stand-ins, match the eager runner token for token and leave
  the same KV cache.
- CUDA (where present): a real capture with narrow tables against eager on a random-weight
  model of SmolLM2-135M's shape, and a capture that really fails (a host read inside it).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from pdmesh.engine.block_hash import HashScheme
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.worker.cuda_graphs import (
    MIN_BLOCKS_PER_SPLIT,
    NARROW_WIDTH,
    WIDTH_STEP,
    DecodeGraphs,
    DecodeSplit,
    _Graph,
    block_table_width,
    capture_sizes,
    decode_splits,
    split_plans,
)
from pdmesh.engine.worker.model_runner import ModelRunner
from pdmesh.engine.worker.models.architecture import ModelConfig
from pdmesh.engine.worker.models.llama import LlamaForCausalLM, RotaryEmbedding
from pdmesh.kernels.backend_selection import get_attention_backend
from tests.engine.test_cuda_graphs import drive, prompts_of
from tests.triton_interpreter import outcomes_of, run_cases

BLOCK_SIZE = 16
CPU = torch.device("cpu")


def _model(cfg: ModelConfig, device: torch.device, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    head = cfg.head_dim
    inv = 1.0 / (10000 ** (torch.arange(0, head, 2, dtype=torch.float) / head))
    rope = RotaryEmbedding(inv, 1.0, cfg.max_position_embeddings)
    return LlamaForCausalLM(cfg, rope).to(device).eval()


TINY = ModelConfig("llama", 96, 32, 64, 2, 2, 1, 16, 1e-5, 2048, False, False, False)
SMOLLM2_135M = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 8192, True, False,
                           False)


def _runner(model: LlamaForCausalLM, backend: str, device: torch.device, num_blocks: int,
            **kwargs: object) -> tuple[ModelRunner, KVCacheManager]:
    cfg = model.cfg
    kv = KVCacheManager(num_blocks, HashScheme(block_size=BLOCK_SIZE), enable_prefix_caching=False)
    cache = torch.zeros(cfg.num_layers, 2, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                        device=device)
    runner = ModelRunner(model, cache, kv, get_attention_backend(backend, device), device,
                         **kwargs)
    return runner, kv


# -- the plan ------------------------------------------------------------------------------------


@pytest.mark.fast
def test_the_block_table_is_as_wide_as_max_model_len_needs() -> None:
    assert block_table_width(4096, 16, 10**6) == 256
    assert block_table_width(1000, 16, 10**6) == 63  # rounded up
    assert block_table_width(131072, 16, 2048) == 2048  # never wider than the cache
    assert block_table_width(1, 16, 10) == 1


@pytest.mark.fast
def test_the_runner_sizes_its_tables_from_max_model_len() -> None:
    model = _model(TINY, CPU)  # 2,048 positions
    runner, _ = _runner(model, "cpu", CPU, 512, max_num_seqs=4, max_model_len=300)
    assert runner.batch.max_blocks_per_seq == 19  # ceil(300 / 16), not 2048 / 16
    runner, _ = _runner(model, "cpu", CPU, 512, max_num_seqs=4)
    assert runner.batch.max_blocks_per_seq == 128  # the position table when none is given
    runner, _ = _runner(model, "cpu", CPU, 64, max_num_seqs=4, max_model_len=2048)
    assert runner.batch.max_blocks_per_seq == 64  # the cache


@pytest.mark.fast
def test_splits_fill_the_sms_for_the_buckets_rows() -> None:
    # Two programs per SM over (row, KV head, split), none shorter than 8 blocks.
    assert decode_splits(1, 8, 2048, 132) == 33
    assert decode_splits(1, 8, 2048, 66) == 17  # a smaller GPU wants fewer
    assert decode_splits(4, 8, 2048, 132) == 9
    assert decode_splits(1, 8, 40, 132) == 40 // MIN_BLOCKS_PER_SPLIT
    assert decode_splits(33, 8, 2048, 132) == 1  # the rows alone fill the SMs
    assert decode_splits(256, 8, 2048, 132) == 1
    assert decode_splits(1, 8, 7, 132) == 1


@pytest.mark.fast
def test_a_short_context_replays_a_graph_with_short_splits() -> None:
    # The case: a 1B Llama (8 KV heads) at batch 1 with 768 tokens of context, on an
    # H100, block table 2,048 blocks wide. One graph per bucket ran 33 splits of 63 blocks:
    # the sequence's 48 blocks all fell in the first split (8 programs x 48 blocks).
    plans = split_plans(1, 8, 2048, 132)
    assert plans == [DecodeSplit(64, 8), DecodeSplit(256, 32), DecodeSplit(1024, 33),
                     DecodeSplit(2048, 33)]
    blocks = 768 // 16
    plan = next(p for p in plans if blocks <= p.width)
    assert plan.blocks_per_split == 8
    active_splits = -(-blocks // plan.blocks_per_split)
    assert (8 * active_splits, min(blocks, plan.blocks_per_split)) == (48, 8)
    # A bucket whose rows fill the SMs needs one graph: one split stops at each context's end.
    assert split_plans(64, 8, 2048, 132) == [DecodeSplit(2048, 1)]


@pytest.mark.fast
@pytest.mark.parametrize("num_kv_heads", [1, 3, 8])
@pytest.mark.parametrize("width", [7, 100, 2048, 8192])
def test_every_context_gets_a_chain_within_a_width_step_of_the_ideal(
        num_kv_heads: int, width: int) -> None:
    for sms in (66, 132):
        for bucket in capture_sizes(256):
            plans = split_plans(bucket, num_kv_heads, width, sms)
            assert plans[-1].width == width
            assert [p.width for p in plans] == sorted({p.width for p in plans})
            assert all(p.width >= NARROW_WIDTH or p.width == width for p in plans)
            full = plans[-1]
            for blocks in range(1, width + 1):
                plan = next(p for p in plans if blocks <= p.width)
                chain = min(plan.blocks_per_split, blocks)  # the kernel stops at the context
                ideal = -(-blocks // full.num_splits)  # every split used, none wasted
                assert chain <= max(2 * MIN_BLOCKS_PER_SPLIT, WIDTH_STEP * ideal + 1), (
                    bucket, sms, blocks, plan)


@pytest.mark.fast
def test_graphs_plan_every_bucket_and_replay_the_narrowest_that_holds_the_step() -> None:
    model = _model(TINY, CPU)  # one KV head
    graphs = DecodeGraphs(model, torch.zeros(1), get_attention_backend("cpu", CPU), CPU, 16,
                          300, num_sms=132)
    assert graphs.block_tables.shape == (16, 300)
    assert graphs.plans[1] == [DecodeSplit(64, 8), DecodeSplit(256, 32), DecodeSplit(300, 37)]
    assert sorted(graphs.plans) == capture_sizes(16)
    stand_ins = {}
    for bucket, plans in graphs.plans.items():
        for split in plans:
            stand_ins[bucket, split.width] = _Graph(_Recorded(), torch.zeros(bucket, 32))
            graphs._store(bucket, split, stand_ins[bucket, split.width])
    assert graphs.captured_sizes == capture_sizes(16)
    assert graphs.num_graphs == sum(len(p) for p in graphs.plans.values())
    assert graphs._graph_for(1, 3) is stand_ins[1, 64]
    assert graphs._graph_for(1, 64) is stand_ins[1, 64]
    assert graphs._graph_for(1, 65) is stand_ins[1, 256]
    assert graphs._graph_for(1, 290) is stand_ins[1, 300]
    graphs.release()
    assert graphs.num_graphs == 0 and graphs.captured_sizes == []
    assert all(g.graph.resets == 1 for g in stand_ins.values())


# -- the fallback ----------------------------------------------------------------------------


class _Recorded:
    """A captured graph's place holder on CPU: counts its resets (release must free all)."""

    def __init__(self) -> None:
        self.resets = 0

    def replay(self) -> None:
        raise AssertionError("a released or failed capture was replayed")

    def reset(self) -> None:
        self.resets += 1


class _FailingCapture(DecodeGraphs):
    """Records `succeed` graphs, then fails the way a capture does when a kernel synchronizes
    with the host. The warm-up is left out: on CPU there is no stream to warm up on."""

    def __init__(self, *args: object, succeed: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.succeed = succeed
        self.recorded: list[_Recorded] = []

    def _warm_up(self, bucket: int, split: DecodeSplit) -> None:
        pass

    def _record(self, bucket: int, split: DecodeSplit) -> _Graph:
        if len(self.recorded) == self.succeed:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        self.recorded.append(_Recorded())
        return _Graph(self.recorded[-1], torch.zeros(bucket, 32))  # type: ignore[arg-type]


@pytest.mark.fast
def test_a_failed_capture_leaves_the_runner_eager_with_the_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    model = _model(TINY, CPU)
    reference, reference_kv = _runner(model, "cpu", CPU, 64, max_num_seqs=8)
    runner, kv = _runner(model, "cpu", CPU, 64, max_num_seqs=8)
    assert runner.cuda_graphs is None and runner.graphs_disabled_reason == "not a CUDA device"
    assert not runner.graphs_capture_failed
    failing = _FailingCapture(model, runner.kv_cache, runner.backend, CPU, 8,
                              runner.batch.max_blocks_per_seq, succeed=3)
    with caplog.at_level(logging.INFO, logger="pdmesh.engine.worker.model_runner"):
        assert runner.use_graphs(failing) is False
    assert runner.cuda_graphs is None and runner.graphs_capture_failed
    assert runner.graphs_disabled_reason == (
        "capture failed: RuntimeError: CUDA error: operation not permitted when stream is "
        "capturing")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cuda_graphs=off fallback=eager" in warnings[0].getMessage()
    # What was captured before the failure is released, pool included.
    assert len(failing.recorded) == 3 and all(g.resets == 1 for g in failing.recorded)
    assert failing.num_graphs == 0 and failing._pool is None
    # It serves, eagerly, exactly what a runner without graphs serves.
    prompts = prompts_of(3, model.cfg.vocab_size, seed=5)
    ref = drive(reference, reference_kv, prompts, new_tokens=6)
    got = drive(runner, kv, prompts, new_tokens=6)
    assert got.tokens == ref.tokens
    for a, b in zip(ref.logits, got.logits, strict=True):
        assert torch.equal(a, b)


# -- the narrow-table replay path, in Triton's interpreter ---------------------------------------


class _EagerReplay:
    """Stands in for a captured graph on CPU: a replay runs the graph's forward eagerly on the
    static buffers, with its plan, into the same output tensor, which is what a replay does."""

    def __init__(self, graphs: DecodeGraphs, bucket: int, split: DecodeSplit) -> None:
        self.graphs, self.bucket, self.split = graphs, bucket, split
        self.hidden = graphs._forward(bucket, split).clone()
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.hidden.copy_(self.graphs._forward(self.bucket, self.split))

    def reset(self) -> None:
        pass


def _narrow_replay_matches_eager(_: object) -> None:
    model = _model(TINY, CPU)
    eager, eager_kv = _runner(model, "triton", CPU, 64, max_num_seqs=8)
    graphed, graphed_kv = _runner(model, "triton", CPU, 64, max_num_seqs=8)
    width = graphed.batch.max_blocks_per_seq
    graphs = DecodeGraphs(model, graphed.kv_cache, graphed.backend, CPU, 8, width)
    stand_ins = {}
    for bucket in graphs.sizes:
        # A 2-block table with 2 splits of 1 block, then the full table with 3 splits: the
        # prompts below start within 2 blocks and grow past them.
        graphs.plans[bucket] = [DecodeSplit(2, 2), DecodeSplit(width, 3)]
        for split in graphs.plans[bucket]:
            stand_in = _EagerReplay(graphs, bucket, split)
            stand_ins[bucket, split.width] = stand_in
            graphs._store(bucket, split, _Graph(stand_in, stand_in.hidden))  # type: ignore[arg-type]
    graphed.cuda_graphs = graphs
    assert not graphed.kv_cache.any(), "warm-up wrote the cache: padding slots are not skipped"
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist()
               for n in (5, 20, 27)]
    ref = drive(eager, eager_kv, prompts, new_tokens=12)  # 27 + 12 tokens: 3 blocks
    got = drive(graphed, graphed_kv, prompts, new_tokens=12, forced=ref.tokens)
    for step, (a, b) in enumerate(zip(ref.logits, got.logits, strict=True)):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    torch.testing.assert_close(graphed.kv_cache, eager.kv_cache, atol=1e-5, rtol=1e-5)
    assert stand_ins[4, 2].replays > 0, "no step replayed the narrow table"
    assert stand_ins[4, width].replays > 0, "no step outgrew the narrow table"


CASES = {"narrow-replay-matches-eager": _narrow_replay_matches_eager}


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str | None]:
    return outcomes_of(__file__)


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_graph_plans_in_the_interpreter(outcomes: dict[str, str | None], name: str) -> None:
    assert outcomes[name] is None, outcomes[name]


# -- CUDA ----------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


class _HostReadInCapture(DecodeGraphs):
    """Reads a value on the host in the smallest bucket's forward, which no capture allows:
    what a kernel path with a host sync does to a capture. Every larger bucket (captured
    first) succeeds, so the failure comes with a pool to free."""

    def _forward(self, bucket: int, split: DecodeSplit | None = None) -> torch.Tensor:
        hidden = super()._forward(bucket, split)
        if bucket == self.sizes[0]:
            hidden.sum().item()
        return hidden


@pytest.mark.slow
@needs_cuda
def test_a_capture_that_really_fails_falls_back_to_eager_on_cuda() -> None:
    model = _model(SMOLLM2_135M, CUDA)
    eager, eager_kv = _runner(model, "triton", CUDA, 256, max_num_seqs=8, enforce_eager=True)
    runner, kv = _runner(model, "triton", CUDA, 256, max_num_seqs=8, enforce_eager=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    failing = _HostReadInCapture(model, runner.kv_cache, runner.backend, CUDA, 8,
                                 runner.batch.max_blocks_per_seq)
    buffers = torch.cuda.memory_allocated() - before
    assert runner.use_graphs(failing) is False
    assert runner.cuda_graphs is None and runner.graphs_capture_failed
    assert str(runner.graphs_disabled_reason).startswith("capture failed: ")
    assert failing.num_graphs == 0
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before <= buffers + 2**20, "the pool was kept"
    prompts = prompts_of(3, model.cfg.vocab_size, seed=7)
    ref = drive(eager, eager_kv, prompts, new_tokens=8)
    got = drive(runner, kv, prompts, new_tokens=8)
    assert got.tokens == ref.tokens


@pytest.mark.slow
@needs_cuda
def test_narrow_and_full_table_graphs_match_eager_on_cuda() -> None:
    model = _model(SMOLLM2_135M, CUDA)
    eager, eager_kv = _runner(model, "triton", CUDA, 512, max_num_seqs=8, enforce_eager=True,
                              max_model_len=4096)
    graphed, graphed_kv = _runner(model, "triton", CUDA, 512, max_num_seqs=8,
                                  max_model_len=4096)
    graphs = graphed.cuda_graphs
    assert graphs is not None, graphed.graphs_disabled_reason
    assert graphs.width == 256
    assert [p.width for p in graphs.plans[1]] == [64, 256]  # 3 KV heads: 1 row needs splits
    assert graphs.num_graphs == sum(len(p) for p in graphs.plans.values())
    width_of = {id(g): graphs.width for g in graphs._graphs.values()}
    width_of.update({id(g): w for tiers in graphs._narrow.values() for w, g in tiers})
    widths: list[int] = []
    pick = graphs._graph_for

    def recording(bucket: int, width: int) -> _Graph:
        captured = pick(bucket, width)
        widths.append(width_of[id(captured)])
        return captured

    graphs._graph_for = recording  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(11)
    for lengths in ((40, 700, 900), (1100,)):  # within 64 blocks; past them
        prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist()
                   for n in lengths]
        ref = drive(eager, eager_kv, prompts, new_tokens=16)
        got = drive(graphed, graphed_kv, prompts, new_tokens=16, forced=ref.tokens)
        assert got.tokens == ref.tokens, lengths
        for step, (a, b) in enumerate(zip(ref.logits, got.logits, strict=True)):
            torch.testing.assert_close(b, a, atol=2e-3, rtol=2e-3, msg=f"step {step}")
    assert set(widths) == {64, 256}, widths


if __name__ == "__main__":
    print(json.dumps(run_cases(CASES, None)))
