"""Engine core socket directories left by dead serving processes are swept; those of live
processes, of another pid namespace, and anything else are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdmesh.engine.frontend.core_client import core_dir_prefix, sweep_core_dirs

pytestmark = pytest.mark.processes


def test_only_the_dirs_of_dead_processes_of_our_namespace_go(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process now
    ours = core_dir_prefix()  # pdmesh-core-<namespace>-<pid>-
    namespace = ours.split("-")[2]
    names = {
        "live": f"{ours}abc123",
        "dead": f"pdmesh-core-{namespace}-{dead.pid}-def456",
        "other_namespace": f"pdmesh-core-1-{dead.pid}-ghi789",
        "unrelated": "pdmesh-core-notours",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "in").touch()
    assert sweep_core_dirs(pids=[os.getpid()], root=str(tmp_path)) == 0  # alive: kept
    assert sweep_core_dirs(root=str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        v for k, v in names.items() if k != "dead")
