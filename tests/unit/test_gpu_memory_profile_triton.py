"""The start-up profiling step through the Triton attention backend (CUDA's default), run in
Triton's interpreter on CPU: its metadata drives the Triton prefill kernels to the reference's
result, and the whole step (forward, LM head, sampler) runs. A wrong layout would otherwise
first show on a GPU, at start-up, where it stops the engine before it serves.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from pdmesh.engine.core.memory_profile import (
    _prefill_metadata,
    profile_kv_cache,
    profile_lengths,
    run_profile_step,
)
from pdmesh.engine.worker.model_loader import load_model
from pdmesh.engine.worker.models.llama import LlamaForCausalLM
from pdmesh.kernels.backend import TorchAttentionBackend
from pdmesh.kernels.backend_selection import get_attention_backend
from tests.triton_interpreter import outcomes_of, run_cases

pytestmark = pytest.mark.processes

CPU = torch.device("cpu")
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False}


def _tiny_model() -> LlamaForCausalLM:
    model_dir = Path(tempfile.mkdtemp())
    (model_dir / "config.json").write_text(json.dumps(TINY))
    model, _, _ = load_model(model_dir, torch.float32, CPU, 256, load_format="dummy")
    return model


def _forward_matches_the_reference(model: LlamaForCausalLM) -> None:
    for lengths in (profile_lengths(96, 5, 256), profile_lengths(96, 1, 256), [1, 33, 16]):
        outs = []
        for backend in (TorchAttentionBackend(), get_attention_backend("triton", CPU)):
            cache = profile_kv_cache(model, lengths, 16, torch.float32, CPU)
            meta, positions = _prefill_metadata(lengths, 16, CPU)
            ids = torch.arange(sum(lengths)) % TINY["vocab_size"]
            outs.append((model(ids, positions, cache, meta, backend), cache))
        (ref, ref_cache), (got, got_cache) = outs
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_cache, ref_cache, rtol=1e-5, atol=1e-5)


def _whole_step_runs(model: LlamaForCausalLM) -> None:
    lengths = profile_lengths(64, 8, 256)
    cache = profile_kv_cache(model, lengths, 16, torch.float32, CPU)
    ids = run_profile_step(model, cache, get_attention_backend("triton", CPU), lengths)
    assert len(ids) == 8 and all(0 <= i < TINY["vocab_size"] for i in ids), ids


CASES = {"forward-matches-reference": _forward_matches_the_reference,
         "whole-step-runs": _whole_step_runs}


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str | None]:
    return outcomes_of(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_profiling_step_in_the_triton_interpreter(outcomes: dict[str, str | None],
                                                  name: str) -> None:
    assert outcomes[name] is None, outcomes[name]


if __name__ == "__main__":
    print(json.dumps(run_cases(CASES, _tiny_model())))
