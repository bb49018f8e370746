"""CUDA graphs for decode steps: buckets, when they are off, and graph-vs-eager parity.

- CPU (always): bucket sizes, graphs absent on CPU and off with enforce_eager or a backend that
  is not graph-safe, and the replay data path — static buffers, padding rows with slot -1,
  buckets — run in Triton's interpreter with an eager stand-in for the captured graph, against
  the eager runner on a tiny random model (logits and the whole KV cache must agree, so a
  padding row that wrote a real slot would show).
- CUDA (where present): real capture and replay of a random-weight model of SmolLM2's shape
  (tests/random_llama.py: no weights travel to a GPU machine) in float32 against the eager
  runner over batch sizes that hit several buckets, two of them padded (3 -> 4, 13 -> 16).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pdmesh.engine.block_hash import HashScheme
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.scheduling.scheduler import ScheduledSeq
from pdmesh.engine.scheduling.sequence import Sequence
from pdmesh.engine.worker.cuda_graphs import (
    DecodeGraphs,
    _Graph,
    capture_sizes,
    graphs_unavailable_reason,
    padded_size,
)
from pdmesh.engine.worker.model_runner import ModelRunner
from pdmesh.engine.worker.models.architecture import ModelConfig
from pdmesh.engine.worker.models.llama import LlamaForCausalLM, RotaryEmbedding
from pdmesh.kernels.backend_selection import get_attention_backend
from tests.random_llama import write_random_llama
from tests.triton_interpreter import outcomes_of, run_cases

BLOCK_SIZE = 16


# -- a greedy driver over the runner alone (no engine) -----------------------------------------


@dataclass
class Run:
    tokens: list[list[int]]  # generated ids per sequence
    logits: list[torch.Tensor]  # per step, the sampling rows in sequence order (CPU)


def drive(
    runner: ModelRunner,
    kv: KVCacheManager,
    prompts: list[list[int]],
    new_tokens: int,
    forced: list[list[int]] | None = None,
) -> Run:
    """Prefill every prompt in one step, then decode them together greedily for `new_tokens`
    steps. With `forced`, those tokens are fed instead of this run's own picks (teacher
    forcing), so two runners see identical inputs and their logits can be compared."""
    seqs = [
        Sequence(f"s{i}", f"r{i}", 0, list(p), len(p), SamplingParams(temperature=0.0))
        for i, p in enumerate(prompts)
    ]
    run = Run([[] for _ in seqs], [])
    scheduled = []
    for seq in seqs:
        assert kv.allocate_slots(seq, seq.num_tokens)
        scheduled.append(ScheduledSeq(seq, seq.num_tokens))
    for step in range(new_tokens):
        inputs = runner.prepare(scheduled)
        logits = runner.execute(inputs)
        for entry in inputs.order:
            entry.seq.num_computed_tokens += entry.num_new_tokens
        rows = torch.tensor([inputs.sample_index[s.seq_id] for s in seqs], device=logits.device)
        picked = logits.index_select(0, rows)
        run.logits.append(picked.cpu())
        for i, (seq, tok) in enumerate(zip(seqs, picked.argmax(dim=-1).tolist(), strict=True)):
            run.tokens[i].append(tok)
            seq.token_ids.append(forced[i][step] if forced is not None else tok)
        scheduled = []
        for seq in seqs:
            assert kv.allocate_slots(seq, 1)
            scheduled.append(ScheduledSeq(seq, 1))
    for seq in seqs:
        kv.free(seq.seq_id)
    assert runner.batch.num_rows == 0
    return run


def prompts_of(batch: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 3 * BLOCK_SIZE, (batch,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def record_buckets(graphs: DecodeGraphs) -> list[int]:
    """Wrap `replay` so a test sees which buckets ran."""
    seen: list[int] = []
    replay = graphs.replay

    def counting(inputs, bucket):  # type: ignore[no-untyped-def]
        seen.append(bucket)
        return replay(inputs, bucket)

    graphs.replay = counting  # type: ignore[method-assign]
    return seen


# -- CPU: buckets and switches -----------------------------------------------------------------


@pytest.mark.fast
def test_capture_sizes_are_vllm_like_and_end_at_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    sizes = capture_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and len(sizes) == 35
    assert [padded_size(n, sizes) for n in (1, 3, 5, 13, 17, 256)] == [1, 4, 8, 16, 24, 256]
    assert padded_size(257, sizes) is None
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def _tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig("llama", 96, 32, 64, 2, 2, 1, 16, 1e-5, 512, False, False, False)
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
    return LlamaForCausalLM(cfg, RotaryEmbedding(inv, 1.0, 512)).eval()


def _tiny_runner(
    model: LlamaForCausalLM, backend: str, **kwargs: object
) -> tuple[ModelRunner, KVCacheManager]:
    kv = KVCacheManager(64, HashScheme(block_size=BLOCK_SIZE), enable_prefix_caching=False)
    cache = torch.zeros(model.cfg.num_layers, 2, 64, BLOCK_SIZE, 1, 16)
    cpu = torch.device("cpu")
    runner = ModelRunner(model, cache, kv, get_attention_backend(backend, cpu), cpu, **kwargs)
    return runner, kv


@pytest.mark.fast
def test_no_graphs_on_cpu() -> None:
    runner, _ = _tiny_runner(_tiny_model(), "cpu", max_num_seqs=8)
    assert runner.cuda_graphs is None


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.mark.fast
def test_when_graphs_are_off() -> None:
    cuda = torch.device("cuda")
    assert graphs_unavailable_reason(cuda, _Named("triton"), enforce_eager=False) is None
    assert "enforce_eager" in str(graphs_unavailable_reason(cuda, _Named("triton"), True))
    for name in ("torch", "flash-attn"):
        assert "not graph-safe" in str(graphs_unavailable_reason(cuda, _Named(name), False))
    cpu = torch.device("cpu")
    assert "not a CUDA device" in str(graphs_unavailable_reason(cpu, _Named("triton"), False))


# -- CPU: the replay data path, in Triton's interpreter --------------------------------------


class _EagerReplay:
    """Stands in for a captured graph on CPU: a replay runs the bucket's forward eagerly on
    the static buffers, into the same output tensor, which is what a replay does."""

    def __init__(self, graphs: DecodeGraphs, bucket: int) -> None:
        self.graphs, self.bucket = graphs, bucket
        self.hidden = graphs._forward(bucket).clone()

    def replay(self) -> None:
        self.hidden.copy_(self.graphs._forward(self.bucket))


def _replay_matches_eager(_: object) -> None:
    model = _tiny_model()
    eager, eager_kv = _tiny_runner(model, "triton", max_num_seqs=8)
    graphed, graphed_kv = _tiny_runner(model, "triton", max_num_seqs=8)
    graphs = DecodeGraphs(model, graphed.kv_cache, graphed.backend, graphed.device, 8,
                          graphed.batch.max_blocks_per_seq)
    for bucket in graphs.sizes:
        stand_in = _EagerReplay(graphs, bucket)
        graphs._graphs[bucket] = _Graph(stand_in, stand_in.hidden)  # type: ignore[arg-type]
    graphed.cuda_graphs = graphs
    assert not graphed.kv_cache.any(), "warm-up wrote the cache: padding slots are not skipped"
    seen = record_buckets(graphs)
    for batch, seed in ((3, 1), (5, 2)):
        prompts = prompts_of(batch, model.cfg.vocab_size, seed)
        ref = drive(eager, eager_kv, prompts, new_tokens=12)
        got = drive(graphed, graphed_kv, prompts, new_tokens=12, forced=ref.tokens)
        for step, (a, b) in enumerate(zip(ref.logits, got.logits, strict=True)):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=f"step {step}")
        # Same KV everywhere: the padding rows wrote nothing, the real rows the same values.
        torch.testing.assert_close(graphed.kv_cache, eager.kv_cache, atol=1e-5, rtol=1e-5)
    assert sorted(set(seen)) == [4, 8], seen  # 3 -> 4 and 5 -> 8: both padded


CASES = {"replay-matches-eager": _replay_matches_eager}


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str | None]:
    return outcomes_of(__file__)


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_graph_replay_path_in_the_interpreter(outcomes: dict[str, str | None], name: str) -> None:
    assert outcomes[name] is None, outcomes[name]


# -- CUDA: real capture and replay ---------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_runner(
    model: LlamaForCausalLM, **kwargs: object
) -> tuple[ModelRunner, KVCacheManager]:
    cfg, cuda = model.cfg, torch.device("cuda")
    kv = KVCacheManager(256, HashScheme(block_size=BLOCK_SIZE), enable_prefix_caching=False)
    cache = torch.zeros(cfg.num_layers, 2, 256, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                        dtype=torch.float32, device=cuda)
    runner = ModelRunner(model, cache, kv, get_attention_backend("triton", cuda), cuda,
                         max_num_seqs=16, **kwargs)
    return runner, kv


@pytest.fixture(scope="module")
def random_smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("random-smollm2"), tokenizer=False)


@pytest.mark.slow
@needs_cuda
def test_cuda_graph_greedy_matches_eager(random_smollm2: Path) -> None:
    from pdmesh.engine.worker.model_loader import load_model

    model, _, _ = load_model(random_smollm2, torch.float32, torch.device("cuda"), 1024)
    eager, eager_kv = _cuda_runner(model, enforce_eager=True)
    graphed, graphed_kv = _cuda_runner(model)
    assert eager.cuda_graphs is None
    assert graphed.cuda_graphs is not None
    assert graphed.cuda_graphs.captured_sizes == [1, 2, 4, 8, 16]
    seen = record_buckets(graphed.cuda_graphs)
    for batch, seed in ((1, 1), (3, 2), (8, 3), (13, 4)):
        prompts = prompts_of(batch, model.cfg.vocab_size, seed)
        ref = drive(eager, eager_kv, prompts, new_tokens=24)
        got = drive(graphed, graphed_kv, prompts, new_tokens=24, forced=ref.tokens)
        assert got.tokens == ref.tokens, f"batch {batch}: greedy tokens differ"
        for step, (a, b) in enumerate(zip(ref.logits, got.logits, strict=True)):
            torch.testing.assert_close(b, a, atol=2e-3, rtol=2e-3, msg=f"step {step}")
    assert sorted(set(seen)) == [1, 4, 8, 16], seen


@pytest.mark.fast
@needs_cuda
def test_enforce_eager_turns_graphs_off_on_cuda() -> None:
    model = _tiny_model().to("cuda")
    runner, _ = _cuda_runner(model, enforce_eager=True)
    assert runner.cuda_graphs is None


if __name__ == "__main__":
    print(json.dumps(run_cases(CASES, None)))
