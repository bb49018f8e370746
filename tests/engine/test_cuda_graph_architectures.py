"""CUDA graphs over what differs between architectures (where CUDA is; random weights, no
download): a decode step with experts (Qwen3-MoE: the grouped GEMM, its offsets on the device)
and one with sliding windows and two RoPE tables (Gemma 3, a 21-token window) are captured and
replay what eager computes, in bfloat16, over batches that pad to several buckets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.test_tp_architectures import SMALL
from tests.random_llama import write_random_llama

pytestmark = [pytest.mark.slow]

CASES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {},
    "gemma3_text": {"sliding_window": 21, "layer_types": ["sliding_attention",
                                                          "full_attention"] * 2},
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("architecture", sorted(CASES))
def test_cuda_graphs_replay_what_eager_computes(tmp_path: Path, architecture: str) -> None:
    from pdmesh.engine.block_hash import HashScheme
    from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
    from pdmesh.engine.worker.model_loader import load_model
    from pdmesh.engine.worker.model_runner import ModelRunner
    from pdmesh.kernels.backend_selection import get_attention_backend
    from tests.engine.test_cuda_graphs import BLOCK_SIZE, drive, prompts_of

    model_dir = write_random_llama(tmp_path / architecture, architecture=architecture,
                                   tokenizer=False, **SMALL, **CASES[architecture])
    cuda = torch.device("cuda")
    model, cfg, _ = load_model(model_dir, torch.bfloat16, cuda, 1024)

    def runner(**kwargs: object) -> tuple[ModelRunner, KVCacheManager]:
        kv = KVCacheManager(256, HashScheme(block_size=BLOCK_SIZE), enable_prefix_caching=False)
        cache = torch.zeros(cfg.num_layers, 2, 256, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                            dtype=torch.bfloat16, device=cuda)
        return ModelRunner(model, cache, kv, get_attention_backend("triton", cuda), cuda,
                           max_num_seqs=16, **kwargs), kv

    eager, eager_kv = runner(enforce_eager=True)
    graphed, graphed_kv = runner()
    assert graphed.cuda_graphs is not None, graphed.graphs_disabled_reason
    assert graphed.cuda_graphs.captured_sizes == [1, 2, 4, 8, 16]
    for batch, seed in ((1, 1), (3, 2), (13, 4)):
        prompts = prompts_of(batch, cfg.vocab_size, seed)
        ref = drive(eager, eager_kv, prompts, new_tokens=16)
        got = drive(graphed, graphed_kv, prompts, new_tokens=16, forced=ref.tokens)
        for step, (a, b) in enumerate(zip(ref.logits, got.logits, strict=True)):
            torch.testing.assert_close(b.float(), a.float(), atol=0.1, rtol=0.05,
                                       msg=f"batch {batch}, step {step}")
