"""The sharded model on real SmolLM2 weights: every rank loads only its slices, and the ranks
together (two and three gloo ranks, on threads of this process) compute the logits of the
whole model."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from pdmesh.engine.worker.model_loader import load_model
from pdmesh.engine.worker.models.llama import LlamaForCausalLM
from pdmesh.engine.worker.parallel.group import join_group
from pdmesh.kernels.backend import AttentionMetadata, TorchAttentionBackend

pytestmark = [pytest.mark.slow, pytest.mark.weights]

IDS = torch.tensor([1, 504, 3458, 282, 4649, 314, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110,
                    120, 49151])
CPU = torch.device("cpu")


def prefill_logits(model: LlamaForCausalLM) -> torch.Tensor:
    """Logits of every row of one prompt run as a single prefill chunk."""
    cfg, t = model.cfg, len(IDS)
    kv = torch.zeros(cfg.num_layers, 2, 2, 16, model.shard.kv_heads.size, cfg.head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(t), num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 2, dtype=torch.long),
        decode_seq_lens=torch.zeros(0, dtype=torch.long),
        prefill_query_start_loc=[0, t], prefill_seq_lens=[t],
        prefill_block_tables=torch.tensor([[0, 1]]))
    hidden = model(IDS, torch.arange(t), kv, meta, TorchAttentionBackend())
    return model.compute_logits(hidden)


@pytest.fixture(scope="module")
def whole(model_dir: Path) -> tuple[LlamaForCausalLM, torch.Tensor]:
    model, _, _ = load_model(model_dir, torch.float32, CPU, 256)
    return model, prefill_logits(model)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_together_compute_the_whole_models_logits(model_dir: Path, whole, tmp_path: Path,
                                                        world: int) -> None:
    model, expected = whole
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            tp = join_group(str(tmp_path / "store"), r, world, CPU, join_timeout_s=60)
            shard, _, _ = load_model(model_dir, torch.float32, CPU, 256, tp=tp)
            results[r] = (shard, prefill_logits(shard))
        except Exception as exc:
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(isinstance(results.get(r), tuple) for r in range(world)), results
    shards = [results[r][0] for r in range(world)]  # type: ignore[index]
    logits = results[0][1]  # type: ignore[index]
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    # No rank holds the whole model: the sharded parameters add up to the model's.
    sizes = [sum(p.numel() for p in s.parameters()) for s in shards]
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert max(sizes) < sum(p.numel() for p in model.parameters())
    assert sum(sizes) == sum(p.numel() for p in model.parameters()) + (world - 1) * norms
    assert sum(s.embed_tokens.weight.shape[0] for s in shards) == model.cfg.vocab_size
