"""Regenerate the Python stubs of every pdmesh.v1 proto, or check the committed ones are current.

The stubs are committed next to their .proto files so that installing pdmesh needs no protoc.
That only stays safe if a stale stub cannot slip through, hence ``--check``: it regenerates
into a temporary directory and fails, naming each file, when the tree differs.

Usage (from the repository root)::

    .venv/bin/python protos/generate.py           # rewrite protos/pdmesh/v1/*_pb2*.py[i]
    .venv/bin/python protos/generate.py --check   # exit 1 and list stale files

The generated code embeds the grpcio-tools/protobuf versions, so the check is only meaningful
with the pinned grpcio-tools; a version bump shows up as every stub being stale.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import importlib.resources
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = Path("pdmesh") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


@dataclass(frozen=True)
class StaleFile:
    """One generated file whose committed copy does not match a fresh generation."""

    path: Path  # relative to the proto root
    problem: str  # "missing", "outdated" or "orphaned"
    diff: str = ""


class GenerationError(RuntimeError):
    """protoc rejected the protos; its diagnostics were printed to stderr."""


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """All protos of the package, sorted so generation order never depends on the filesystem."""
    return sorted((proto_root / PACKAGE_DIR).glob("*.proto"))


def is_generated(path: Path) -> bool:
    return path.name.endswith(GENERATED_SUFFIXES)


def generated_files(directory: Path) -> set[Path]:
    """Generated stubs under ``directory``, relative to it."""
    package = directory / PACKAGE_DIR
    if not package.is_dir():
        return set()
    return {p.relative_to(directory) for p in package.iterdir() if is_generated(p)}


def generate(proto_root: Path, out_dir: Path) -> set[Path]:
    """Run protoc on every proto under ``proto_root`` writing into ``out_dir``; returns outputs."""
    from grpc_tools import protoc  # only needed here; grpcio-tools is a dev dependency

    protos = proto_files(proto_root)
    if not protos:
        raise GenerationError(f"no .proto files under {proto_root / PACKAGE_DIR}")
    well_known_types = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known_types}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise GenerationError("protoc failed on " + ", ".join(p.name for p in protos))
    return generated_files(out_dir)


def find_stale(proto_root: Path = PROTO_ROOT) -> list[StaleFile]:
    """Compare the committed stubs with a fresh generation; empty means everything is current."""
    with tempfile.TemporaryDirectory(prefix="pdmesh-protos-") as tmp:
        return _compare(proto_root, Path(tmp))


def write(proto_root: Path = PROTO_ROOT) -> list[StaleFile]:
    """Regenerate in place, touching only stubs that change; returns what was fixed.

    Unchanged files keep their bytes and timestamps, so regenerating never shows up as an edit
    to protos nobody touched. Stubs whose proto is gone are deleted.
    """
    with tempfile.TemporaryDirectory(prefix="pdmesh-protos-") as tmp:
        fresh_root = Path(tmp)
        stale = _compare(proto_root, fresh_root)
        for item in stale:
            if item.problem == "orphaned":
                (proto_root / item.path).unlink()
            else:
                shutil.copyfile(fresh_root / item.path, proto_root / item.path)
        return stale


def _compare(proto_root: Path, fresh_root: Path) -> list[StaleFile]:
    """Generate into ``fresh_root`` and list every committed stub that differs from it."""
    expected = generate(proto_root, fresh_root)
    committed = generated_files(proto_root)
    stale = [StaleFile(p, "orphaned") for p in sorted(committed - expected)]
    for rel in sorted(expected):
        target = proto_root / rel
        if not target.exists():
            stale.append(StaleFile(rel, "missing"))
            continue
        want = (fresh_root / rel).read_text()
        have = target.read_text()
        if want != have:
            stale.append(StaleFile(rel, "outdated", _short_diff(have, want, rel)))
    return stale


def _short_diff(have: str, want: str, rel: Path, max_lines: int = 20) -> str:
    lines = list(
        difflib.unified_diff(
            have.splitlines(),
            want.splitlines(),
            fromfile=f"committed/{rel}",
            tofile=f"generated/{rel}",
            lineterm="",
        )
    )
    if len(lines) > max_lines:
        lines = [*lines[:max_lines], f"... ({len(lines) - max_lines} more diff lines)"]
    return "\n".join(lines)


def _tools_version() -> str:
    try:
        return importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="do not write; exit 1 if any stub is stale"
    )
    parser.add_argument("--proto-root", type=Path, default=PROTO_ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if not args.check:
            fixed = write(args.proto_root)
            for item in fixed:
                print(f"{'removed' if item.problem == 'orphaned' else 'wrote'} {item.path}")
            if not fixed:
                print("protos: generated stubs were already current")
            return 0
        stale = find_stale(args.proto_root)
    except GenerationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not stale:
        print("protos: generated stubs are current")
        return 0
    print(
        f"protos: {len(stale)} stale generated file(s) (grpcio-tools {_tools_version()}); "
        "run `python protos/generate.py`:",
        file=sys.stderr,
    )
    for item in stale:
        print(f"  {item.problem}: {item.path}", file=sys.stderr)
        if item.diff:
            print(item.diff, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
