"""The engine's device, spelled out and made current at start-up (`device="cuda:N"`).

CUDA's current device is per thread, and Triton launches, graph capture and `Event.record()`
act on the current device's stream: an engine on cuda:1 that never made it current would run
them against device 0. CPU (always): how a device string resolves. CUDA (where present): after
start-up on cuda:0 (and cuda:1 when there is one) that device is current and holds the model
and the cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core.startup import (
    engine_device,
    make_device_current,
    resolve_engine_device,
    set_up_engine,
)

pytestmark = pytest.mark.fast


def test_cuda_without_an_index_is_the_current_device() -> None:
    assert engine_device(torch.device("cuda"), current_index=1, device_count=2) == torch.device(
        "cuda", 1)
    assert engine_device(torch.device("cuda:0"), current_index=1, device_count=2) == (
        torch.device("cuda", 0))
    assert engine_device(torch.device("cuda", 1), current_index=0, device_count=2).index == 1


def test_a_cuda_device_that_is_not_there_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"cuda:2 does not exist \(2 CUDA devices are visible"):
        engine_device(torch.device("cuda:2"), current_index=0, device_count=2)
    with pytest.raises(ValueError, match="cuda:0 does not exist"):
        engine_device(torch.device("cuda"), current_index=0, device_count=0)


def test_cpu_stays_cpu_and_touches_no_cuda() -> None:
    assert engine_device(torch.device("cpu"), current_index=0, device_count=0) == torch.device(
        "cpu")
    device = resolve_engine_device(EngineConfig(device="cpu"))
    assert device == torch.device("cpu")
    initialized = torch.cuda.is_initialized()
    make_device_current(device)
    assert torch.cuda.is_initialized() == initialized


def _smollm2_shape(path: Path) -> Path:
    """Random weights of SmolLM2-135M's shape: config.json only."""
    path.mkdir(parents=True, exist_ok=True)
    shape = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
             "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
             "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
             "max_position_embeddings": 8192, "tie_word_embeddings": True}
    (path / "config.json").write_text(json.dumps(shape))
    return path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("index", [0, 1])
def test_start_up_makes_the_engines_device_current(tmp_path: Path, index: int) -> None:
    if index >= torch.cuda.device_count():
        pytest.skip(f"needs {index + 1} CUDA devices")
    before = torch.cuda.current_device()
    try:
        setup = set_up_engine(EngineConfig(model=str(_smollm2_shape(tmp_path / "m")),
                                           load_format="dummy", device=f"cuda:{index}",
                                           kv_cache_memory="64MiB"))
        assert torch.cuda.current_device() == index
        assert setup.device == torch.device("cuda", index)
        assert setup.kv_cache.device == setup.device
        assert setup.model.embed_tokens.weight.device == setup.device
    finally:
        torch.cuda.set_device(before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_plain_cuda_resolves_to_the_current_index() -> None:
    assert resolve_engine_device(EngineConfig(device="cuda")) == torch.device(
        "cuda", torch.cuda.current_device())
