"""`pdmesh serve` failing to start says why, last: a busy port is refused before anything
starts, naming the port and its flag; a child's fatal error ends what it prints."""

from __future__ import annotations

import socket
import subprocess

import pytest

from pdmesh.serve import pdmesh_command

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.processes, pytest.mark.redis]


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(pdmesh_command("serve", *args), capture_output=True, text=True,
                          timeout=240, check=False)


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_a_busy_port_is_refused_before_anything_starts(flag: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = serve("--colocated", "--port", "0", "--grpc-port", "0", flag, str(port))
    assert proc.returncode == 1 and "ready" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert str(port) in last and flag in last and "already in use" in last.lower(), last
    assert "pdmesh decode" not in proc.stderr, "an engine started"


def test_a_childs_fatal_error_is_the_last_thing_printed() -> None:
    proc = serve("/no/such/model", "--colocated", "--port", "0")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-2:]
    assert "colocated-0" in last[0] and "exit code 1" in last[0], last
    assert "/no/such/model" in last[1] and "neither a known alias" in last[1], last
