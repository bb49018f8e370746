"""`pdmesh serve` restarts whatever dies: one real mesh, its children SIGKILLed one by one.

One `pdmesh serve smollm2` (redis-server, one colocated engine, router, gateway on a free
port, an API key) serves the module. Each test SIGKILLs one child, then waits (bounded) for a
new process in its place and for a new HTTP request on the same port to succeed: router,
gateway (whose command line never shows the API key), Redis (reaped, not left a zombie; the
engine registers again), and last the engine, whose engine core's socket directory must not be
left behind.
"""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import psutil
import pytest
import redis

from pdmesh.serve import Child, pdmesh_command
from tests.polling import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

RESTART_S = 60.0  # bound on a restart (an engine loads its model again) plus the next request
API_KEY = "sk-supervision-test-key"


@dataclass
class Serve:
    child: Child
    base_url: str
    redis_url: str

    def process(self, name: str) -> psutil.Process | None:
        """The live `pdmesh <name>` (or redis-server) process under `pdmesh serve`."""
        for proc in psutil.Process(self.child.pid).children(recursive=True):
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                cmdline = proc.cmdline()
            except psutil.NoSuchProcess:
                continue
            if name == "redis" and cmdline and "redis-server" in cmdline[0]:
                return proc
            if "pdmesh.cli" in cmdline and name in cmdline:
                return proc
        return None

    def pid_of(self, name: str) -> int | None:
        proc = self.process(name)
        return proc.pid if proc is not None else None

    def completion(self, key: str = API_KEY) -> int | None:
        """The status of a small completion, None when nothing answered."""
        try:
            return httpx.post(f"{self.base_url}/v1/completions", timeout=30,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"prompt": "The capital of France is", "max_tokens": 2}
                              ).status_code
        except httpx.TransportError:
            return None

    def completes(self) -> bool:
        return self.completion() == 200

    def kill_and_wait_for_restart(self, name: str) -> tuple[int, int]:
        old = self.pid_of(name)
        assert old is not None, f"no {name} under pdmesh serve"
        psutil.Process(old).kill()
        new = wait_for(lambda: (pid := self.pid_of(name)) not in (None, old) and pid,
                       f"a new {name} process", timeout_s=RESTART_S)
        wait_for(self.completes, f"a completion after the {name} restart", timeout_s=RESTART_S)
        return old, new


@pytest.fixture(scope="module")
def serve() -> Iterator[Serve]:
    child = Child("serve", pdmesh_command(
        "serve", "smollm2", "--colocated", "--num-decode", "1", "--kv-cache-memory", "64MiB",
        "--port", "0", "--drain-timeout-s", "5", "--api-key", API_KEY))
    try:
        child.wait_ready(timeout_s=240)
        redis_url = next(word.strip("(,") for line in child.lines for word in line.split()
                         if word.startswith("redis://"))
        serve = Serve(child, child.fields["gateway"].removesuffix("/v1"), redis_url)
        assert serve.completes()
        yield serve
    finally:
        child.terminate(grace_s=60)
    assert child.proc.returncode == 0
    # Its last words: every child it lost while serving, and why.
    deaths = [line for line in child.last_words() if "while serving" in line]
    assert deaths and all("killed by SIGKILL" in line for line in deaths), child.last_words()


def test_router_sigkill(serve: Serve) -> None:
    serve.kill_and_wait_for_restart("router")


def test_gateway_sigkill(serve: Serve) -> None:
    serve.kill_and_wait_for_restart("gateway")
    gateway = serve.process("gateway")
    assert gateway is not None
    assert not any(API_KEY in arg for arg in gateway.cmdline()), "the key is visible to ps"
    assert serve.completion(key="sk-wrong") == 401


def test_redis_sigkill_is_reaped_and_the_engine_registers_again(serve: Serve) -> None:
    old, _ = serve.kill_and_wait_for_restart("redis")
    wait_for(lambda: not psutil.pid_exists(old), "the dead redis-server to be reaped")
    index = redis.Redis.from_url(serve.redis_url)
    try:
        wait_for(lambda: index.dbsize() > 0, "the engine to register in the new redis",
                 timeout_s=RESTART_S)
    finally:
        index.close()


def test_engine_sigkill_leaves_no_core_socket_dir(serve: Serve) -> None:
    """Last: the engine takes longest to come back."""
    engine = serve.pid_of("decode")
    assert engine is not None
    pattern = os.path.join(tempfile.gettempdir(), f"pdmesh-core-*-{engine}-*")
    assert glob.glob(pattern), "the engine's core should have its socket dir"
    serve.kill_and_wait_for_restart("decode")
    assert not glob.glob(pattern)
