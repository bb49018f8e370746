"""A Mistral checkpoint with a sliding window, on random weights: the engine serves it with
max_model_len capped to the window, and within it computes what transformers computes with its
sliding-window attention (prompt logprobs, float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdmesh import LLM
from tests.engine.test_tp_architectures import SMALL, engine_logprobs, transformers_logprobs
from tests.random_llama import write_random_llama

pytestmark = [pytest.mark.slow]

WINDOW = 16  # PROMPT_IDS are 15 tokens: all within it


def test_a_windowed_model_is_exact_within_its_window(tmp_path: Path) -> None:
    model_dir = write_random_llama(tmp_path / "mistral", architecture="mistral",
                                   sliding_window=WINDOW, **SMALL)
    expected = transformers_logprobs(model_dir)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB")
    assert llm.engine.max_model_len == WINDOW
    torch.testing.assert_close(engine_logprobs(llm), expected, atol=2e-3, rtol=1e-3)
    with pytest.raises(ValueError, match=f"sliding attention window of {WINDOW} tokens"):
        LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB",
            max_model_len=WINDOW * 2)
