"""Run Triton kernel cases in Triton's interpreter, on CPU, from a pytest module.

The interpreter needs TRITON_INTERPRET=1 before triton itself is imported, so a test module
runs itself as a script in a child process started with that flag; the child runs every
registered case and prints each one's outcome as JSON; each pytest test asserts one case.
Nothing leaks into the pytest process, which stays compiled-mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any


def run_cases(cases: dict[str, Callable[[Any], None]], arg: Any) -> dict[str, str | None]:
    """In the interpreter process: every case's failure message, or None when it passed."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    outcome: dict[str, str | None] = {}
    for name, fn in cases.items():
        try:
            fn(arg)
            outcome[name] = None
        except Exception as exc:  # reported to the parent, which fails that test
            outcome[name] = f"{type(exc).__name__}: {exc}"
    return outcome


def outcomes_of(script: str, timeout_s: float = 600) -> dict[str, str | None]:
    """Run `script` (a test module whose `__main__` prints `run_cases(...)` as JSON) in a
    child with TRITON_INTERPRET=1 and return its outcomes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # for `import tests.*`
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
