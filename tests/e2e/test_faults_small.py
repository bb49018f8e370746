"""Regressions for the small defects of issue 12, item 6, on a real `pdmesh serve`.

One mesh (`pdmesh serve`: redis-server, 1 prefill, 1 decode over the shm KV backend, router,
gateway) serves the module; the last test SIGKILLs its prefill and then stops the mesh.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import psutil
import pytest

from pdmesh.kvstore.transfer.backends.base import DEFAULT_SHM_DIR
from pdmesh.serve import Child, pdmesh_command
from tests.metrics_text import counter
from tests.polling import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

SEGMENT = re.compile(r"pdmesh-kv-\d+-(\d+)-[0-9a-f]{32}")




@dataclass
class Serve:
    child: Child
    base_url: str
    metrics: dict[str, str]  # child name -> /metrics URL, as `pdmesh serve` printed them

    def engine_pid(self, role: str) -> int:
        """The pid of the `pdmesh <role>` process under `pdmesh serve`."""
        for proc in psutil.Process(self.child.pid).children(recursive=True):
            cmdline = proc.cmdline()
            if "pdmesh.cli" in cmdline and role in cmdline:
                return proc.pid
        raise AssertionError(f"no {role} process under pdmesh serve")


def segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir(DEFAULT_SHM_DIR)
            if (m := SEGMENT.fullmatch(n)) and int(m.group(1)) == pid]


@pytest.fixture(scope="module")
def serve() -> Iterator[Serve]:
    child = Child("serve", pdmesh_command(
        "serve", "--num-prefill", "1", "--num-decode", "1", "--kv-cache-memory", "64MiB",
        "--kv-backend", "shm", "--local-prefill-threshold", "0", "--gateway-port", "0"))
    try:
        child.wait_ready(timeout_s=240)
        gateway = child.fields["gateway"].removesuffix("/v1")
        metrics = {parts[1]: parts[2] for line in child.lines
                   if len(parts := line.split()) == 3 and parts[0] == "metrics"}
        yield Serve(child, gateway, metrics)
    finally:
        child.terminate(grace_s=60)


def test_serve_prints_every_metrics_url(serve: Serve) -> None:
    assert {"prefill-0", "decode-0", "router", "gateway"} <= set(serve.metrics)
    for url in serve.metrics.values():
        assert "pdmesh:" in httpx.get(url, timeout=10).text


def test_seed_out_of_range_is_400_naming_seed(serve: Serve) -> None:
    url = f"{serve.base_url}/v1/completions"
    body = {"prompt": "Hello", "max_tokens": 2}
    resp = httpx.post(url, json={**body, "seed": 2**70}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "seed"
    for seed in (2**63 - 1, -(2**63), 0):  # vLLM's range: a signed 64-bit integer
        assert httpx.post(url, json={**body, "seed": seed}, timeout=60).status_code == 200


def test_unknown_chat_role_is_400(serve: Serve) -> None:
    url = f"{serve.base_url}/v1/chat/completions"
    messages = [{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "Obey."}]
    resp = httpx.post(url, json={"messages": messages, "max_tokens": 2}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "messages[1].role" and "wizard" in error["message"]


def test_client_disconnect_counts_as_cancelled_on_decode(serve: Serve) -> None:
    decode_metrics = serve.metrics["decode-0"]

    def outcomes() -> tuple[float, float]:
        text = httpx.get(decode_metrics, timeout=10).text
        return (counter(text, "pdmesh:requests_total", role="decode", outcome="cancelled"),
                counter(text, "pdmesh:requests_total", role="decode", outcome="error"))

    cancelled, errors = outcomes()
    body = {"prompt": "Count to a thousand:", "max_tokens": 1000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream(
        "POST", f"{serve.base_url}/v1/completions", json=body
    ) as resp:
        assert resp.status_code == 200
        got = 0
        for line in resp.iter_lines():
            got += line.startswith("data:")
            if got >= 3:
                break  # leaving the block closes the connection mid-stream
    wait_for(lambda: outcomes()[0] == cancelled + 1, "the decode to count one cancel")
    assert outcomes()[1] == errors


def test_segments_of_a_killed_prefill_are_removed(serve: Serve) -> None:
    """Last: SIGKILL the prefill after it sent KV through shm; `pdmesh serve` cleans up."""
    prefill = serve.engine_pid("prefill")
    resp = httpx.post(f"{serve.base_url}/v1/completions",
                      json={"prompt": "The capital of France is", "max_tokens": 4}, timeout=60)
    assert resp.status_code == 200
    assert segments_of(prefill), "the prefill should keep its used segment in its pool"
    psutil.Process(prefill).kill()
    wait_for(lambda: not segments_of(prefill), "the killed prefill's segments to be removed")
    serve.child.terminate(grace_s=60)
    assert not segments_of(prefill)
