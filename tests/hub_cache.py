"""A Hugging Face Hub cache built on local disk, for tests of Hub ids without the Hub.

The layout is huggingface_hub's (`models--org--name/snapshots/<commit>/<file>`, and
`refs/<branch or tag>` holding the commit), so `snapshot_download(..., local_files_only=True)`
finds it exactly as it finds a real download. Files are written, or symlinked to real ones
(the converted SmolLM2 checkpoint) so a test costs no copy of the weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path

SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The Hub id of the model the `smollm2` alias converts from GGUF."""


def commit_of(label: str) -> str:
    """A 40-hex commit id, stable per label (huggingface_hub treats such a revision as a
    commit and looks up `snapshots/<it>` directly)."""
    return hashlib.sha1(label.encode()).hexdigest()


def put_snapshot(cache: Path, repo_id: str, commit: str,
                 files: Mapping[str, str | bytes | Path], refs: Iterable[str] = ("main",)
                 ) -> Path:
    """Add `repo_id`'s snapshot at `commit` to the cache `cache` (a Path file is symlinked),
    pointed at by `refs`; return the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, content in files.items():
        target = snapshot / name
        if isinstance(content, Path):
            target.symlink_to(content.resolve())
        elif isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def model_files(model_dir: Path) -> dict[str, str | bytes | Path]:
    """Every file of a local HF-format directory, as symlinks to pass to `put_snapshot`."""
    return {p.name: p for p in sorted(model_dir.iterdir()) if p.is_file()}
