"""vLLM's `--hf-overrides`: a JSON object merged over the model's config.json before anything
reads it, so every engine (and every tensor-parallel rank) builds the same model from it: a
longer `max_position_embeddings`, a `rope_scaling`, a changed `sliding_window`.

A key is replaced by the override's value, as vLLM sets the attribute; only a sub-config (a key
ending in `_config` whose value is an object, such as `text_config`) is updated key by key.
`model_type` cannot change: the checkpoint's weights are one architecture's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdmesh.config import json_object_flag

MAX_HF_OVERRIDES_BYTES = 64 * 1024


def parse_hf_overrides(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """`--hf-overrides` (JSON text, or a mapping from the offline `LLM`) as a dict; ValueError
    naming the flag when it is not a JSON object of config keys."""
    if isinstance(value, str) and \
            len(value.encode("utf-8", "surrogatepass")) > MAX_HF_OVERRIDES_BYTES:
        raise ValueError(f"--hf-overrides: at most {MAX_HF_OVERRIDES_BYTES} bytes")
    value = json_object_flag("--hf-overrides", value, what=" of config.json keys",
                             example='{"max_position_embeddings": 4096}')
    if "model_type" in value:
        raise ValueError("--hf-overrides cannot set model_type: the checkpoint's weights are "
                         "of one architecture")
    bad = [k for k in value if not isinstance(k, str) or not k]
    if bad:
        raise ValueError(f"--hf-overrides: keys must be non-empty strings, got {bad[0]!r}")
    return value


def apply_hf_overrides(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's dict with `overrides` merged over it (the module doc's rule)."""
    merged = dict(config)
    for key, value in overrides.items():
        current = merged.get(key)
        if key.endswith("_config") and isinstance(current, Mapping) and \
                isinstance(value, Mapping):
            merged[key] = {**current, **value}
        else:
            merged[key] = value
    return merged
