"""Phi-3 / Phi-4 checkpoints (random weights): q/k/v and gate/up stored fused, which the loader
splits so the usual fusing and tensor-parallel slicing apply. The engine's prompt logprobs are
transformers' Phi3ForCausalLM's; two ranks: tests/engine/test_tp_architectures.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdmesh import LLM
from tests.engine.test_tp_architectures import SMALL, engine_logprobs, transformers_logprobs
from tests.random_llama import write_random_llama

pytestmark = [pytest.mark.slow]


def test_phi3_computes_what_transformers_computes(tmp_path: Path) -> None:
    model_dir = write_random_llama(tmp_path / "phi3", architecture="phi3", **SMALL)
    expected = transformers_logprobs(model_dir)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB")
    torch.testing.assert_close(engine_logprobs(llm), expected, atol=2e-3, rtol=1e-3)
