"""One scrape of a `pdmesh serve` mesh (`--metrics-names vllm`): the gateway's /metrics on the
HTTP port carries the router's, the engine's and its own series, each labelled with its
process, plus vLLM's names for the engine's, so a vLLM dashboard pointed at the API port works.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.serve import LocalMesh, MeshConfig
from tests.polling import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def mesh() -> Iterator[LocalMesh]:
    config = MeshConfig(colocated=True, gateway_port=0, kv_cache_memory="96MiB",
                        metrics_names="vllm")
    with LocalMesh(config) as local:
        yield local


def scrape(url: str) -> tuple[str, Samples]:
    resp = httpx.get(url, timeout=30)
    assert resp.status_code == 200, resp.text
    samples: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, f"series given twice: {key}"
            samples[key] = s.value
    return resp.text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


def test_the_api_port_serves_every_process_with_vllm_names(mesh: LocalMesh) -> None:
    assert mesh.gateway_url is not None
    body = {"model": "smollm2", "prompt": "Name a primary color.", "max_tokens": 3,
            "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{mesh.gateway_url}/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    url = mesh.metrics_urls()["gateway"]
    engine = {"service": "colocated-0", "role": "colocated", "model_name": "smollm2"}

    def finished() -> tuple[str, Samples] | None:
        text, samples = scrape(url)
        return (text, samples) if value(
            samples, "vllm:request_success_total", finished_reason="length", **engine) else None

    text, samples = wait_for(finished, "the engine's finished request on the one scrape", 30)
    for kind in ("HELP", "TYPE"):
        names = [line.split()[2] for line in text.splitlines() if line.startswith(f"# {kind} ")]
        assert len(names) == len(set(names)), f"a family's # {kind} given twice"
    up = {dict(ls)["target"]: v for (n, ls), v in samples.items()
          if n == "pdmesh:metrics_scrape_up"}
    assert up == {"colocated-0": 1, "router": 1}
    # Each process's series, labelled with it.
    assert value(samples, "pdmesh:router_requests_total", service="router", code="OK") >= 1
    assert value(samples, "pdmesh:router_instances", service="router", role="colocated",
                 state="healthy") == 1
    assert value(samples, "pdmesh:requests_total", outcome="length", **engine) >= 1
    assert value(samples, "pdmesh:kv_cache_total_blocks", **engine) > 0
    assert value(samples, "pdmesh:gateway_requests_total", service="gateway") >= 1
    # vLLM's names for the engine's quantities, with vLLM's labels.
    vllm = {**engine, "engine": "0"}
    assert value(samples, "vllm:generation_tokens_total", **vllm) >= 3
    assert value(samples, "vllm:prompt_tokens_total", **vllm) > 0
    assert value(samples, "vllm:time_to_first_token_seconds_count", **vllm) >= 1
    assert value(samples, "vllm:e2e_request_latency_seconds_count", **vllm) >= 1
    assert value(samples, "vllm:request_prompt_tokens_count", **vllm) >= 1
    assert ("vllm:kv_cache_usage_perc", frozenset(vllm.items())) in samples
    assert ("vllm:num_requests_running", frozenset(vllm.items())) in samples
    # The engine's own port (as Kubernetes scrapes it) names alike: the switch reached it.
    _, own = scrape(mesh.metrics_urls()["colocated-0"])
    assert value(own, "vllm:generation_tokens_total", engine="0", role="colocated") >= 3
    assert not [k for k in own if "service" in dict(k[1])]
