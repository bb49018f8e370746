"""Gemma 3's multimodal checkpoints (gemma-3-4b-it and larger: Gemma3ForConditionalGeneration)
served as text models: the config's text_config and the language model's tensors are read,
the vision tower's never. The engine's prompt logprobs are transformers' multimodal model's
on a text-only prompt. Gemma 3 text-only checkpoints: tests/engine/test_sliding_window.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdmesh import LLM
from tests.engine.test_tp_architectures import PROMPT_IDS, SMALL, engine_logprobs
from tests.random_llama import write_random_gemma3_multimodal

pytestmark = [pytest.mark.slow]


def test_a_multimodal_gemma3_serves_its_language_model(tmp_path: Path) -> None:
    from transformers import Gemma3ForConditionalGeneration

    model_dir = write_random_gemma3_multimodal(tmp_path / "gemma3", **SMALL, sliding_window=6)
    hf = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([PROMPT_IDS])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(
        1, torch.tensor(PROMPT_IDS[1:])[:, None])[:, 0]
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB")
    torch.testing.assert_close(engine_logprobs(llm), expected, atol=2e-3, rtol=1e-3)
