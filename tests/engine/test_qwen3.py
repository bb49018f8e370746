"""Qwen3 checkpoints on random weights: per-head q/k RMSNorms before RoPE, no q/k/v bias, and
a head_dim that is not hidden_size / heads (Qwen3's 128 under a narrower hidden size). The
engine's prompt logprobs match transformers' Qwen3ForCausalLM on the same weights, whole and
on two tensor-parallel ranks (tests/engine/test_tp_architectures.py runs the second), and its
greedy tokens are transformers' greedy tokens."""

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

QWEN3 = {**SMALL, "head_dim": 64, "attention_bias": False}  # 8 heads x 64 > hidden 256


def test_qwen3_computes_what_transformers_computes(tmp_path: Path) -> None:
    model_dir = write_random_llama(tmp_path / "qwen3", architecture="qwen3", **QWEN3)
    expected = transformers_logprobs(model_dir)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB")
    torch.testing.assert_close(engine_logprobs(llm), expected, atol=2e-3, rtol=1e-3)


def test_qwen3_greedy_tokens_are_transformers_greedy_tokens(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = write_random_llama(tmp_path / "qwen3", architecture="qwen3", **QWEN3)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ids = model.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=12, do_sample=False,
                             min_new_tokens=12)[0, len(PROMPT_IDS):].tolist()
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB")
    try:
        out = llm.generate([{"prompt_token_ids": PROMPT_IDS}],
                           SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    finally:
        llm.engine.core.close()
    assert list(out.outputs[0].token_ids) == ids
