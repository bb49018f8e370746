"""The engine's rooms keep their order, and docs/ARCHITECTURE.md's reading order names every module.

The engine is layered: `engine/` (light contracts every process may import) < `structured/` <
`scheduling/` < `worker/` < `core/` < `frontend/`. A module imports only from its own room or
rooms before it, anywhere in its body (a function-level import is still a dependency), so the
core never reaches back into the serving side and the worker never into the core that drives it.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[2]
ORDER = ("top", "structured", "scheduling", "worker", "core", "frontend")


def _room(parts: tuple[str, ...]) -> str:
    return parts[0] if len(parts) > 1 and parts[0] in ORDER else "top"


def _engine_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m.startswith("pdmesh.engine.")}


def test_engine_imports_only_run_down_the_rooms() -> None:
    engine = REPO / "engine"
    upward = []
    for path in sorted(engine.rglob("*.py")):
        own = _room(path.relative_to(engine).parts)
        for module in _engine_imports(path):
            target = _room(tuple(module.split(".")[2:]))
            if ORDER.index(target) > ORDER.index(own):
                upward.append(f"{path.relative_to(REPO)} ({own}) imports {module} ({target})")
    assert not upward, "\n".join(upward)


def test_reading_order_names_every_module() -> None:
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    reading = text[text.index("## Reading order"):]
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    missing = [
        f for f in tracked
        if not f.startswith(("tests/", "bench/", "scripts/"))
        and not f.endswith(("__init__.py", "_pb2.py", "_pb2_grpc.py"))
        and not any(f"`{'/'.join(f.split('/')[-k:])}`" in reading for k in (1, 2, 3, 4))
    ]
    assert not missing, f"docs/ARCHITECTURE.md's reading order misses {missing}"
