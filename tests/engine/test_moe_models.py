"""Mixture-of-experts checkpoints on random weights (Mixtral, Qwen2-MoE with its shared expert,
Qwen3-MoE with dense layers among the sparse ones): the engine's prompt logprobs are
transformers' on the same weights, and its greedy tokens are transformers' greedy tokens.
Two tensor-parallel ranks: tests/engine/test_tp_architectures.py (every architecture); CUDA
graphs over experts: tests/engine/test_cuda_graph_architectures.py."""

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
