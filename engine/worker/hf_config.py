"""A checkpoint's config.json as the engine reads it: as plain attributes where it states
everything the model needs (transformers' AutoConfig costs ~80 MiB of every engine core's
RSS), else transformers' interpretation; `--hf-overrides` merged over it first; a multimodal
checkpoint's `text_config` where only its language model is served."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pdmesh.engine.hf_overrides import apply_hf_overrides
from pdmesh.engine.worker.models.architecture import DENSE_MODEL_TYPES

# config.json keys the model needs that transformers would otherwise default.
_REQUIRED_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "rms_norm_eps",
                  "max_position_embeddings")
_REQUIRED_BY_TYPE = {"qwen3": ("head_dim",)}
"""Keys a model type defaults otherwise than hidden_size / heads (Qwen3's head_dim: 128)."""


def load_hf_config(model_dir: Path, overrides: Mapping[str, Any] | None = None) -> object:
    """The model's config: config.json (with `--hf-overrides` merged over it) read as it is when
    it states everything the model reads with default RoPE (transformers' AutoConfig, ~80 MiB
    of every engine core's RSS, would only fill in what it states), else transformers'
    interpretation of it."""
    raw = _read_config(model_dir / "config.json")
    if overrides:
        if raw is None:
            raise ValueError(f"--hf-overrides: {model_dir / 'config.json'} is not a JSON object")
        raw = apply_hf_overrides(raw, overrides)
    light = _plain_config(raw) if raw is not None else None
    if light is not None:
        return light
    from transformers import AutoConfig

    if not overrides:
        config = AutoConfig.from_pretrained(model_dir)
    else:
        assert raw is not None
        fields = {k: v for k, v in raw.items() if k != "model_type"}
        config = AutoConfig.for_model(raw.get("model_type", ""), **fields)
    if getattr(config, "model_type", "") in TEXT_OF_MULTIMODAL:
        text = config.text_config  # the language model is what pdmesh serves
        # The multimodal model ties (or not) its language model's head, whatever the
        # text_config says: transformers reads the top-level flag.
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings",
                                                text.tie_word_embeddings))
        return text
    return config


TEXT_OF_MULTIMODAL = ("gemma3",)
"""Multimodal model types whose language model is served on its own: their config's
`text_config` is the model's, their checkpoint's language-model tensors its weights (the
vision tower's are not read)."""
def _read_config(path: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _plain_config(raw: dict[str, Any]) -> SimpleNamespace | None:
    """config.json as attributes, or None where transformers must interpret it (a model type
    we do not run, a missing key it would default, scaled RoPE, no RoPE base)."""
    if raw.get("model_type") not in DENSE_MODEL_TYPES:  # MoE keys vary: transformers reads
        return None
    if raw.get("use_sliding_window"):  # which layers slide: transformers' layer_types
        return None
    required = (*_REQUIRED_KEYS, *_REQUIRED_BY_TYPE.get(str(raw.get("model_type")), ()))
    if any(raw.get(key) is None for key in required):
        return None
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or params.get("rope_type", "default") != "default":
            return None
        if params.get("rope_theta") is None:
            return None
    elif raw.get("rope_scaling") is not None or raw.get("rope_theta") is None:
        return None
    return SimpleNamespace(**raw)


