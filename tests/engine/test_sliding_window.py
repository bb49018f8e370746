"""A Mistral checkpoint with a sliding window, on random weights: the engine serves it with
max_model_len capped to the window, and within it computes what transformers computes with its
sliding-window attention (prompt logprobs, float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdmesh import LLM, SamplingParams
from tests.engine.test_tp_architectures import PROMPT_IDS, SMALL, transformers_logprobs
from tests.random_llama import write_random_llama

pytestmark = [pytest.mark.slow]

WINDOW = 16  # PROMPT_IDS are 15 tokens: all within it


def test_a_windowed_model_is_exact_within_its_window(tmp_path: Path) -> None:
    model_dir = write_random_llama(tmp_path / "mistral", architecture="mistral",
                                   sliding_window=WINDOW, **SMALL)
    expected = transformers_logprobs(model_dir)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB")
    try:
        assert llm.engine.max_model_len == WINDOW
        out = llm.generate([{"prompt_token_ids": PROMPT_IDS}],
                           SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    finally:
        llm.engine.core.close()
    got = torch.tensor([out.prompt_logprobs[i][PROMPT_IDS[i]].logprob
                        for i in range(1, len(PROMPT_IDS))])
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    with pytest.raises(ValueError, match=f"sliding attention window of {WINDOW} tokens"):
        LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB",
            max_model_len=WINDOW * 2)
