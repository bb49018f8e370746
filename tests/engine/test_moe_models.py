"""Mixture-of-experts checkpoints on random weights (Mixtral, Qwen2-MoE with its shared expert,
Qwen3-MoE with dense layers among the sparse ones): the engine's prompt logprobs are
transformers' on the same weights, its greedy tokens are transformers' greedy tokens, and on
CUDA a decode step with experts is captured in a CUDA graph and replays what eager computes.
Two tensor-parallel ranks: tests/engine/test_tp_architectures.py (every architecture)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdmesh import LLM, SamplingParams
from tests.engine.test_tp_architectures import (
    PROMPT_IDS,
    SMALL,
    engine_logprobs,
    transformers_logprobs,
)
from tests.random_llama import write_random_llama

pytestmark = [pytest.mark.slow]

CASES = {
    "mixtral": {},
    "qwen2_moe": {},
    # Layers 0 and 2 dense (decoder_sparse_step 2), layer 3 named dense too: only 1 is sparse.
    "qwen3_moe": {"decoder_sparse_step": 2, "mlp_only_layers": [3]},
}


@pytest.mark.parametrize("architecture", sorted(CASES))
def test_experts_compute_what_transformers_computes(tmp_path: Path, architecture: str) -> None:
    model_dir = write_random_llama(tmp_path / architecture, architecture=architecture,
                                   **SMALL, **CASES[architecture])
    expected = transformers_logprobs(model_dir)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB")
    torch.testing.assert_close(engine_logprobs(llm), expected, atol=2e-3, rtol=1e-3)


def test_greedy_tokens_with_experts_are_transformers_greedy_tokens(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = write_random_llama(tmp_path / "mixtral", architecture="mixtral", **SMALL)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [PROMPT_IDS, PROMPT_IDS[3:]]
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                   min_new_tokens=12)[0, len(p):].tolist() for p in prompts]
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB")
    try:
        # Two prompts in one batch: each token's experts are its own whatever shares the step.
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    finally:
        llm.engine.core.close()
    assert [list(out.outputs[0].token_ids) for out in outs] == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_capture_experts_and_replay_what_eager_computes(tmp_path: Path) -> None:
    from pdmesh.engine.block_hash import HashScheme
    from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
    from pdmesh.engine.worker.model_loader import load_model
    from pdmesh.engine.worker.model_runner import ModelRunner
    from pdmesh.kernels.backend_selection import get_attention_backend
    from tests.engine.test_cuda_graphs import BLOCK_SIZE, drive, prompts_of

    model_dir = write_random_llama(tmp_path / "qwen3_moe", architecture="qwen3_moe",
                                   tokenizer=False, **SMALL)
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
