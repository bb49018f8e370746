"""Server sampling defaults from a model's `generation_config.json`, with vLLM's precedence.

A model's authors say how it should be sampled in its generation config (e.g. temperature 0.2,
top_p 0.9); a client that says nothing about sampling should get that, not the API's bare
defaults (temperature 1.0), which make small models babble. vLLM's rule, kept here:
**request > server default > OpenAI default**. A field the request sets wins; a field it leaves
unset takes the model's value; a field neither sets keeps the API default.

`--generation-config` chooses the source, as in vLLM: `auto` (the model directory's file),
`vllm` (none: plain API defaults) or the path of a directory holding a generation_config.json.
`--override-generation-config` (a JSON object in the file's own names, e.g. `{"temperature":
0.5, "max_new_tokens": 256}`) is merged over what the source gives, as vLLM merges it: over the
model's file with `auto`, alone with `vllm`.

The router resolves sampling for the whole mesh (`apply_to_proto` on each Generate request,
before anything is forwarded), so the gateway and direct gRPC callers get the same defaults;
the offline `LLM` uses `sampling_params` for calls that pass no SamplingParams.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pdmesh.config import json_object_flag
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.v1 import common_pb2

logger = logging.getLogger(__name__)

SOURCES = ("auto", "vllm")
"""Named sources; anything else is a directory path."""

FILENAME = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling fields a generation config may set; None = not set there."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # from max_new_tokens

    def as_dict(self) -> dict[str, Any]:
        """Only the fields that are set."""
        return {k: v for k, v in asdict(self).items() if v is not None}


def check_source(source: str) -> None:
    """Raise ValueError naming the flag when `source` is neither a name nor a directory."""
    if source in SOURCES:
        return
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ValueError(f"--generation-config must be auto, vllm or a directory holding "
                         f"{FILENAME}; {source!r} is not a directory")
    if not (path / FILENAME).is_file():
        raise ValueError(f"--generation-config: {path} holds no {FILENAME}")


def parse_override(override: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """`--override-generation-config` (JSON text, or a mapping from the offline `LLM`) as a
    dict; ValueError naming the flag when it is not an object whose sampling fields read."""
    raw = json_object_flag("--override-generation-config", override,
                           example='{"temperature": 0.5}')
    try:
        from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--override-generation-config: {exc}") from None
    return raw


def load_generation_defaults(source: str, model_dir: Path | str,
                             override: str | Mapping[str, Any] | None = None
                             ) -> GenerationDefaults:
    """The defaults `source` names for the model in `model_dir`, with `override` merged over
    them (see the module doc)."""
    check_source(source)
    extra = parse_override(override)
    raw: dict[str, Any] = {}
    path = Path(model_dir if source == "auto" else source).expanduser() / FILENAME
    if source != "vllm" and path.is_file():  # auto, and the model may ship none
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--generation-config: cannot read {path}: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"--generation-config: {path} does not hold a JSON object")
    defaults = from_dict({**raw, **extra})
    if defaults.as_dict():
        where = f"{path if raw else 'none'}{' + --override-generation-config' if extra else ''}"
        logger.info("sampling defaults from %s: %s", where, defaults.as_dict())
    return defaults


def from_dict(raw: dict[str, Any]) -> GenerationDefaults:
    """The sampling fields of a parsed generation_config.json.

    `do_sample: false` means greedy whatever temperature says (transformers' rule). A field
    equal to transformers' own default (temperature 1.0, top_p 1.0, top_k 50 without explicit
    sampling...) is still taken as written: it is what the file says.
    """
    values: dict[str, Any] = {}
    for name, cast in (("temperature", float), ("top_p", float), ("top_k", int),
                       ("min_p", float), ("repetition_penalty", float)):
        if raw.get(name) is not None:
            values[name] = cast(raw[name])
    if raw.get("max_new_tokens") is not None:
        values["max_tokens"] = int(raw["max_new_tokens"])
    if raw.get("do_sample") is False:
        values["temperature"] = 0.0
    return GenerationDefaults(**values)


def apply_to_proto(
    sampling: common_pb2.SamplingParams, defaults: GenerationDefaults
) -> common_pb2.SamplingParams:
    """A copy of the wire `sampling` with every field the request left unset taken from
    `defaults`. Unset means: not present (optional fields) or 0 for `top_k` / `min_p`, whose
    0 is also their "off" (a client can still turn top-k off explicitly with -1)."""
    merged = common_pb2.SamplingParams()
    merged.CopyFrom(sampling)
    for name, value in defaults.as_dict().items():
        if name in ("top_k", "min_p"):
            if not getattr(merged, name):
                setattr(merged, name, value)
        elif not merged.HasField(name):
            setattr(merged, name, value)
    return merged


def default_sampling_params(defaults: GenerationDefaults, **overrides: Any) -> SamplingParams:
    """SamplingParams built from the defaults, with `overrides` (the caller's own) winning."""
    known = {f.name for f in fields(SamplingParams)}
    values = {k: v for k, v in defaults.as_dict().items() if k in known}
    values.update(overrides)
    return SamplingParams(**values)
