"""A checkpoint with a sliding attention window (Mistral v0.1, Qwen2 with use_sliding_window)
is served with max_model_len at most its window: pdmesh computes full attention, which equals
the model's own only within the window (vLLM's --disable-sliding-window)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdmesh.engine.core.startup import model_max_positions

pytestmark = pytest.mark.fast

CONFIG = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "rope_theta": 10000.0}


def model(tmp_path: Path, **fields: Any) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, **fields}))
    return tmp_path


@pytest.mark.parametrize(("fields", "limit"), [
    ({"model_type": "mistral", "sliding_window": 4096}, 4096),  # Mistral-7B-v0.1
    ({"model_type": "mistral"}, 4096),  # transformers' default where the file says nothing
    ({"model_type": "mistral", "sliding_window": None}, 8192),  # v0.2 on: full attention
    ({"model_type": "mistral", "sliding_window": 16384}, 8192),  # wider than the model
    ({"model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": False}, 8192),
    ({"model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": True}, 1024),
    ({"model_type": "qwen3", "sliding_window": 1024, "use_sliding_window": False}, 8192),
    ({"model_type": "llama"}, 8192),
])
def test_the_position_limit_is_the_window(tmp_path: Path, fields: dict[str, Any],
                                          limit: int) -> None:
    assert model_max_positions(model(tmp_path, **fields), None) == limit


def test_asking_past_the_window_names_it(tmp_path: Path) -> None:
    path = model(tmp_path, model_type="mistral", sliding_window=4096)
    assert model_max_positions(path, 4096) == 4096
    with pytest.raises(ValueError, match=r"sliding attention window of 4096 tokens.*"
                                         r"--max-model-len 4096 or less"):
        model_max_positions(path, 4097)
    with pytest.raises(ValueError, match="max_position_embeddings=8192"):
        model_max_positions(path, 9000)
