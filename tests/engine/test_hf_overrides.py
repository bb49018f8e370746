"""`--hf-overrides` reaches the model the engine builds: on random Llama weights, a RoPE scaling
given only as an override gives the prompt logprobs transformers computes with that scaling
written into config.json (and not the unscaled ones), and a `max_position_embeddings` override
is the engine's position limit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdmesh import LLM
from tests.engine.test_tp_architectures import SMALL, engine_logprobs, transformers_logprobs
from tests.random_llama import write_random_llama

pytestmark = [pytest.mark.slow]

SCALING = {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}


def test_overrides_build_the_model_transformers_builds_from_them(tmp_path: Path) -> None:
    model_dir = write_random_llama(tmp_path / "llama", **SMALL)
    scaled_dir = tmp_path / "scaled"  # the same checkpoint, the override written in
    shutil.copytree(model_dir, scaled_dir)
    config = json.loads((scaled_dir / "config.json").read_text())
    (scaled_dir / "config.json").write_text(json.dumps({**config, **SCALING}))
    expected, unscaled = transformers_logprobs(scaled_dir), transformers_logprobs(model_dir)
    assert not torch.allclose(expected, unscaled, atol=1e-2)  # the scaling shows in them
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB",
              hf_overrides=json.dumps(SCALING))
    torch.testing.assert_close(engine_logprobs(llm), expected, atol=2e-3, rtol=1e-3)
    short = LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB",
                hf_overrides={"max_position_embeddings": 64})
    try:
        assert short.engine.max_model_len == 64
    finally:
        short.engine.core.close()
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=64"):
        LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB", max_model_len=128,
            hf_overrides={"max_position_embeddings": 64})
