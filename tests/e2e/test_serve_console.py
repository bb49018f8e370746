"""`pdmesh serve` as a vLLM user meets it: a quiet console, and vLLM's /ping and /v1/models.

Started and stopped with Ctrl-C (SIGINT) as a user does, it prints its ready lines and no
`nanobind: leaked ...` report: on a CPU-only host no process imports triton, whose bindings
printed ~60 such lines at every exit (tests/unit/test_quiet_model_load.py has the cause).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from pdmesh.serve import pdmesh_command

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]


def wait_for_ready(proc: subprocess.Popen[bytes], out: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        ready = [line for line in out.read_text().splitlines() if line.startswith("ready ")]
        if ready:
            return ready[0]
        time.sleep(0.5)
    raise AssertionError(f"pdmesh serve never became ready:\n{out.read_text()[-3000:]}")


def test_start_serve_and_ctrl_c_print_no_leak_report(tmp_path: Path) -> None:
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(pdmesh_command("serve", "smollm2", "--port", "0",
                                               "--kv-cache-memory", "64MiB"),
                                stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        ready = wait_for_ready(proc, out, timeout_s=240)
        base = next(p for p in ready.split() if p.startswith("gateway=")).removeprefix(
            "gateway=").removesuffix("/v1")
        assert httpx.get(f"{base}/ping", timeout=10).status_code == 200
        assert httpx.post(f"{base}/ping", timeout=10).status_code == 200
        (card,) = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
        assert card["id"] == "smollm2" and card["root"] == "smollm2", card
        assert card["max_model_len"] > 0 and card["permission"], card
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    console = out.read_text() + err.read_text()
    assert "nanobind" not in console and "leaked" not in console, console[-3000:]
