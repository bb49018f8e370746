"""Which layers of a checkpoint attend over a sliding window, and how wide (Mistral v0.1, Qwen2
with use_sliding_window and its max_window_layers, configs listing layer_types); the window
does not limit max_model_len: the kernels mask outside it (kernels/torch_ref.py), so the whole
context of max_position_embeddings is served."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdmesh.engine.core.startup import model_max_positions
from pdmesh.engine.worker.hf_config import load_hf_config
from pdmesh.engine.worker.models.architecture import ModelConfig

pytestmark = pytest.mark.fast

CONFIG = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "rope_theta": 10000.0}


def model(tmp_path: Path, **fields: Any) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, **fields}))
    return tmp_path


@pytest.mark.parametrize(("fields", "windows"), [
    ({"model_type": "mistral", "sliding_window": 4096}, (4096,) * 4),  # Mistral-7B-v0.1
    ({"model_type": "mistral"}, (4096,) * 4),  # transformers' default where the file is silent
    ({"model_type": "mistral", "sliding_window": None}, (0,) * 4),  # v0.2 on: full attention
    ({"model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": False}, (0,) * 4),
    ({"model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": True,
      "max_window_layers": 2}, (0, 0, 1024, 1024)),
    ({"model_type": "qwen3", "sliding_window": 1024, "use_sliding_window": False}, (0,) * 4),
    ({"model_type": "llama"}, (0,) * 4),
])
def test_each_layer_has_its_window(tmp_path: Path, fields: dict[str, Any],
                                   windows: tuple[int, ...]) -> None:
    path = model(tmp_path, **fields)
    assert ModelConfig.from_hf(load_hf_config(path)).windows == windows
    assert model_max_positions(path, None) == 8192  # the whole context, windows or not


def test_max_model_len_is_limited_by_the_positions_only(tmp_path: Path) -> None:
    path = model(tmp_path, model_type="mistral", sliding_window=4096)
    assert model_max_positions(path, 8192) == 8192
    with pytest.raises(ValueError, match="max_position_embeddings=8192"):
        model_max_positions(path, 9000)


def test_disable_sliding_window_caps_max_model_len_to_the_window(tmp_path: Path) -> None:
    """vLLM's --disable-sliding-window: full attention everywhere, so contexts stop at the
    window, where full attention equals the model's own."""
    path = model(tmp_path, model_type="mistral", sliding_window=4096)
    assert model_max_positions(path, None, None, disable_sliding_window=True) == 4096
    with pytest.raises(ValueError, match="window of 4096 tokens"):
        model_max_positions(path, 4097, None, disable_sliding_window=True)
    (tmp_path / "llama").mkdir()
    llama = model(tmp_path / "llama", model_type="llama")
    assert model_max_positions(llama, None, None, disable_sliding_window=True) == 8192


def test_the_flag_is_an_engine_option() -> None:
    from pdmesh.engine.config import EngineConfig
    from pdmesh.serve.vllm_flags import SAME_AS_PDMESH

    assert EngineConfig(model="m", disable_sliding_window=True).disable_sliding_window
    assert "--disable-sliding-window" not in SAME_AS_PDMESH


def test_gemma3_facts(tmp_path: Path) -> None:
    """Gemma 3: sliding layers on the local RoPE base, every sixth layer full on the global
    one; sqrt(hidden) embeddings; query_pre_attn_scalar; GeGLU; attention soft-capping refused."""
    fields = {**CONFIG, "num_hidden_layers": 7, "model_type": "gemma3_text", "head_dim": 16,
              "sliding_window": 512, "query_pre_attn_scalar": 64,
              "hidden_activation": "gelu_pytorch_tanh"}
    cfg = ModelConfig.from_hf(load_hf_config(model(tmp_path, **fields)))
    assert cfg.windows == (512,) * 5 + (0, 512)
    assert cfg.local_rope_layers == (True,) * 5 + (False, True)
    assert (cfg.embed_scale, cfg.attn_scale, cfg.hidden_act) == (8.0, 0.125, "gelu_pytorch_tanh")
    (tmp_path / "capped").mkdir()
    with pytest.raises(ValueError, match="soft-capping"):
        ModelConfig.from_hf(load_hf_config(model(tmp_path / "capped", **fields,
                                                 attn_logit_softcapping=50.0)))
    (tmp_path / "relu").mkdir()
    with pytest.raises(ValueError, match="hidden_act 'relu' is not supported"):
        ModelConfig.from_hf(load_hf_config(model(tmp_path / "relu", model_type="llama",
                                                 hidden_act="relu")))
