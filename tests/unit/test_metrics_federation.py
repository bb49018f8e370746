"""One scrape for a `pdmesh serve` mesh (gateway/metrics_federation.py) and vLLM's names as a
view of pdmesh's (pdmesh/metrics_vllm.py): merged expositions parse, name each family once and
keep the processes' series apart; a process that does not answer is marked down within the
timeout; the vLLM view renames without re-bucketing or double counting."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.gateway.app import create_app
from pdmesh.gateway.config import GatewayConfig
from pdmesh.gateway.metrics import GatewayMetrics
from pdmesh.gateway.metrics_federation import (
    MetricsTarget,
    Scrape,
    federated_exposition,
    merge,
    parse_targets,
)
from pdmesh.metrics import (
    REQUEST_TOKENS_BUCKETS,
    TOKEN_LATENCY_BUCKETS_S,
    EngineCollector,
    EngineState,
    RouterCollector,
    RouterState,
    engine_metrics,
    router_metrics,
    start_metrics_server,
)
from pdmesh.metrics_vllm import NAMES_ENV, metrics_names, vllm_view
from pdmesh.serve import Endpoint, LocalMesh, MeshConfig
from pdmesh.serve import mesh as serve_mesh

pytestmark = pytest.mark.fast

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def engine_registry(role: str = "decode", running: int = 2) -> CollectorRegistry:
    r = CollectorRegistry()
    m = engine_metrics(role, r, model_name="smol")
    for outcome in ("stop", "cancelled", "abort", "exported", "finished_on_prefill"):
        m.request_finished(outcome=outcome, prompt_tokens=12, generation_tokens=3, ttft_s=0.1,
                           e2e_s=0.3, queue_s=0.01)
    m.inter_token(0.02)
    r.register(EngineCollector(role, lambda: EngineState(
        num_running=running, num_waiting=1, kv_usage=0.25, num_free_blocks=30,
        num_total_blocks=40, num_pinned_blocks=0, prefix_query_tokens=100,
        prefix_hit_tokens=64, index_up=True), model_name="smol"))
    return r


def router_registry() -> CollectorRegistry:
    r = CollectorRegistry()
    router_metrics(r).requests.labels("OK").inc(5)
    r.register(RouterCollector(lambda: RouterState(
        running=1, queued=0, inflight_tokens=9, instances=[("decode", True)], index_up=True)))
    return r


def text(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def parse(body: str) -> Samples:
    """{(sample, labels): value}; fails on a series given twice."""
    out: Samples = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"series given twice: {key}"
            out[key] = s.value
    return out


def declared_once(body: str) -> None:
    for kind in ("HELP", "TYPE"):
        names = re.findall(rf"^# {kind} (\S+)", body, flags=re.M)
        dupes = sorted({n for n in names if names.count(n) > 1})
        assert not dupes, f"# {kind} given more than once for {dupes}"


def value(samples: Samples, name: str, **labels: str) -> float:
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert hits, f"no {name} {labels}"
    return sum(hits)


def target(name: str) -> MetricsTarget:
    return MetricsTarget(name, f"http://127.0.0.1:1/{name}")


# -- the merge ------------------------------------------------------------------------------------
def test_merge_is_one_valid_exposition_with_every_process_apart() -> None:
    gateway = GatewayMetrics()
    gateway.requests.labels("/v1/completions", "200").inc()
    scrapes = [
        Scrape(target("router"), text(router_registry()), 0.01),
        Scrape(target("decode-0"), text(engine_registry(running=2)), 0.01),
        Scrape(target("decode-1"), text(engine_registry(running=5)), 0.01),  # same labels inside
        Scrape(target("prefill-0"), None, 2.0, "ConnectError"),
        Scrape(target("broken"), "this is { not an exposition", 0.01),
    ]
    body = merge(gateway.registry, scrapes).decode()
    declared_once(body)
    samples = parse(body)
    running = "pdmesh:num_requests_running"
    assert value(samples, running, service="decode-0", role="decode", model_name="smol") == 2
    assert value(samples, running, service="decode-1") == 5
    assert value(samples, "pdmesh:router_requests_total", service="router", code="OK") == 5
    assert value(samples, "pdmesh:gateway_requests_total", service="gateway") == 1
    # pdmesh:index_up comes from the router (no labels) and the engines (model_name, role).
    assert value(samples, "pdmesh:index_up", service="router") == 1
    assert value(samples, "pdmesh:index_up", service="decode-1", role="decode") == 1
    up = {dict(ls)["target"]: v for (n, ls), v in samples.items()
          if n == "pdmesh:metrics_scrape_up"}
    assert up == {"router": 1, "decode-0": 1, "decode-1": 1, "prefill-0": 0, "broken": 0}
    assert not [k for k in samples if dict(k[1]).get("service") in ("prefill-0", "broken")]
    assert all("service" in dict(ls) for _, ls in samples), "every series names its process"


def test_targets_are_validated_at_start_up() -> None:
    assert parse_targets(["router=127.0.0.1:9400", "d=https://[::1]:5/m", "h:7"]) == (
        MetricsTarget("router", "http://127.0.0.1:9400/metrics"),
        MetricsTarget("d", "https://[::1]:5/m"), MetricsTarget("h:7", "http://h:7/metrics"))
    for bad in (["x=ftp://a:1/m"], ["x=nohost"], ["x=a:port"], ["gateway=a:1"],
                ["x=a:1", "x=b:2"], ["x y=a:1"]):
        with pytest.raises(ValueError, match="--metrics-federate"):
            GatewayConfig(metrics_federate=tuple(bad))
    with pytest.raises(ValueError, match="--metrics-federate-timeout-s"):
        GatewayConfig(metrics_federate_timeout_s=0)
    with pytest.raises(ValueError, match="--metrics-names"):
        GatewayConfig(metrics_names="sglang")


# -- fetching -------------------------------------------------------------------------------------
@pytest.fixture
def servers() -> Iterator[dict[str, str]]:
    """Two live /metrics servers, a closed port and a port that accepts but never answers."""
    live = {"router": start_metrics_server("127.0.0.1", 0, router_registry(), names="pdmesh"),
            "decode-0": start_metrics_server("127.0.0.1", 0, engine_registry(), names="vllm")}
    with socket.socket() as closed, socket.socket() as silent:
        closed.bind(("127.0.0.1", 0))
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes connections; nobody ever reads them
        urls = {name: e.url for name, e in live.items()}
        urls["prefill-0"] = f"http://127.0.0.1:{closed.getsockname()[1]}/metrics"
        urls["silent"] = f"http://127.0.0.1:{silent.getsockname()[1]}/metrics"
        try:
            yield urls
        finally:
            for e in live.values():
                e.close()


def test_fetches_are_concurrent_bounded_and_a_dead_process_is_marked_down(
        servers: dict[str, str]) -> None:
    targets = [MetricsTarget(n, u) for n, u in servers.items()]
    start = time.monotonic()
    body = asyncio.run(federated_exposition(CollectorRegistry(), targets, timeout_s=0.5,
                                            names="vllm")).decode()
    assert time.monotonic() - start < 3.0  # one timeout, not one per dead target
    declared_once(body)
    samples = parse(body)
    up = {dict(ls)["target"]: v for (n, ls), v in samples.items()
          if n == "pdmesh:metrics_scrape_up"}
    assert up == {"router": 1, "decode-0": 1, "prefill-0": 0, "silent": 0}
    # decode-0 serves vLLM's names itself; the gateway's view adds none a second time.
    assert value(samples, "vllm:num_requests_running", service="decode-0", engine="0") == 2


def test_the_gateway_route_serves_the_mesh(servers: dict[str, str]) -> None:
    config = GatewayConfig(metrics_federate=(f"router={servers['router']}",
                                             f"prefill-0={servers['prefill-0']}"),
                           metrics_federate_timeout_s=0.5)
    with TestClient(create_app(config, client=object())) as http:  # type: ignore[arg-type]
        resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = parse(resp.text)
    assert value(samples, "pdmesh:router_requests_total", service="router") == 5
    assert value(samples, "pdmesh:metrics_scrape_up", target="prefill-0") == 0
    plain = GatewayConfig()  # outside pdmesh serve: the gateway's own, no service label
    with TestClient(create_app(plain, client=object())) as http:  # type: ignore[arg-type]
        own = parse(http.get("/metrics").text)
    assert own and not [k for k in own if "service" in dict(k[1])]


# -- vLLM's names ---------------------------------------------------------------------------------
def test_vllm_names_are_a_view_with_pdmesh_buckets_and_vllm_labels() -> None:
    families = list(vllm_view(engine_registry().collect()))
    body = generate_latest(_Collected(families)).decode()
    declared_once(body)
    samples = parse(body)
    vllm = {"model_name": "smol", "engine": "0", "role": "decode"}
    assert value(samples, "vllm:num_requests_running", **vllm) == 2
    assert value(samples, "vllm:num_requests_waiting", **vllm) == 1
    assert value(samples, "vllm:kv_cache_usage_perc", **vllm) == 0.25
    assert value(samples, "vllm:prefix_cache_queries_total", **vllm) == 100
    assert value(samples, "vllm:prefix_cache_hits_total", **vllm) == 64
    assert value(samples, "vllm:prompt_tokens_total", **vllm) == 5 * 12
    assert value(samples, "vllm:generation_tokens_total", **vllm) == 5 * 3
    success = {dict(ls)["finished_reason"]: v for (n, ls), v in samples.items()
               if n == "vllm:request_success_total"}
    assert success == {"stop": 1, "abort": 2}  # cancelled is vLLM's abort; exported is no finish
    for name, buckets in (("vllm:request_time_per_output_token_seconds", TOKEN_LATENCY_BUCKETS_S),
                          ("vllm:request_prompt_tokens", REQUEST_TOKENS_BUCKETS)):
        les = {float(dict(ls)["le"]) for n, ls in samples if n == f"{name}_bucket"}
        assert les == {*map(float, buckets), float("inf")}
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_generation_tokens"):
        assert value(samples, f"vllm:{name}_count", **vllm) == 5
    assert value(samples, "vllm:inter_token_latency_seconds_count", **vllm) == 1
    assert value(samples, "vllm:request_prompt_tokens_sum", **vllm) == 5 * 12
    # The originals stay, unchanged; a second pass adds nothing.
    assert value(samples, "pdmesh:requests_total", outcome="exported") == 1
    assert len(vllm_view(families)) == len(families)


def test_the_switch_reaches_every_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAMES_ENV, raising=False)
    assert metrics_names() == "pdmesh"
    monkeypatch.setenv(NAMES_ENV, "vllm")
    assert metrics_names() == "vllm"  # router and engines: start_metrics_server(names=None)
    monkeypatch.setenv(NAMES_ENV, "tgi")
    with pytest.raises(ValueError, match=NAMES_ENV):
        metrics_names()
    assert serve_mesh.NAMES_ENV == NAMES_ENV
    local = LocalMesh(MeshConfig(redis_url="redis://127.0.0.1:1/0", metrics_names="vllm"),
                      env={"PATH": "/bin"})
    local.endpoints["router"] = Endpoint("127.0.0.1:5001", metrics_port=5002)
    local.pinned_metrics.update({"decode-0": "http://127.0.0.1:6002/metrics",
                                 "router": "http://127.0.0.1:5002/metrics"})
    argv = local._gateway_argv()
    assert argv[argv.index("--metrics-names") + 1] == "vllm"
    assert argv[argv.index("--metrics-federate") + 1] == (
        "decode-0=http://127.0.0.1:6002/metrics,router=http://127.0.0.1:5002/metrics")
    assert local._service_env() == {"PATH": "/bin", NAMES_ENV: "vllm"}
    assert LocalMesh(MeshConfig(redis_url="redis://127.0.0.1:1/0"), env={})._service_env() == {}


class _Collected:
    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self) -> Iterator:
        return iter(self.families)
