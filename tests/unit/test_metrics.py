"""pdmesh.metrics: the catalog, the collectors and the /metrics endpoint."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.metrics import (
    EngineCollector,
    EngineState,
    RouterCollector,
    RouterState,
    engine_metrics,
    kv_transfer_metrics,
    router_metrics,
    start_metrics_server,
)

pytestmark = pytest.mark.fast


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("pdmesh:"), family.name
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def state(**overrides: object) -> EngineState:
    values = dict(num_running=2, num_waiting=1, kv_usage=0.25, num_free_blocks=30,
                  num_total_blocks=40, num_pinned_blocks=3, prefix_query_tokens=100,
                  prefix_hit_tokens=64, index_up=True, num_steps=7, step_seconds=0.5,
                  scheduled_tokens=90)
    values.update(overrides)
    return EngineState(**values)  # type: ignore[arg-type]


def test_every_metric_of_every_service_has_the_prefix_and_its_values() -> None:
    r = CollectorRegistry()
    engine = engine_metrics("decode", r, model_name="smol")
    kv = kv_transfer_metrics(r)
    router = router_metrics(r)
    r.register(EngineCollector("decode", state, model_name="smol"))
    r.register(RouterCollector(lambda: RouterState(
        running=1, queued=0, inflight_tokens=50,
        instances=[("decode", True), ("prefill", False)], index_up=False)))
    engine.request_finished(outcome="stop", prompt_tokens=10, generation_tokens=5, ttft_s=0.1,
                            e2e_s=0.5, queue_s=0.01)
    engine.inter_token(0.02)
    kv.observe("received", "shm", 4096, 0.002, "ok")
    kv.observe("received", "tcp", 0, 0.0, "timeout")
    router.routing_decisions.labels("prefix_aware", "decode", "cached_prefix").inc()
    got = samples(r)
    role = frozenset({("model_name", "smol"), ("role", "decode")})
    assert got[("pdmesh:prefix_cache_hits_total", role)] == 64
    assert got[("pdmesh:prefix_cache_queries_total", role)] == 100
    assert got[("pdmesh:kv_cache_usage_ratio", role)] == 0.25
    assert got[("pdmesh:num_requests_running", role)] == 2
    assert got[("pdmesh:engine_steps_total", role)] == 7
    assert got[("pdmesh:engine_step_seconds_total", role)] == 0.5
    assert got[("pdmesh:engine_scheduled_tokens_total", role)] == 90
    assert got[("pdmesh:index_up", role)] == 1
    assert got[("pdmesh:index_up", frozenset())] == 0
    assert got[("pdmesh:time_per_output_token_seconds_sum", role)] == pytest.approx(0.1)
    assert got[("pdmesh:generation_tokens_total", role)] == 5
    assert got[("pdmesh:inter_token_latency_seconds_count", role)] == 1
    sent = frozenset({("direction", "received"), ("backend", "shm")})
    assert got[("pdmesh:kv_transfer_bytes_total", sent)] == 4096
    assert got[("pdmesh:kv_transfer_failures_total",
                frozenset({("direction", "received"), ("reason", "timeout")}))] == 1
    assert ("pdmesh:kv_transfer_bytes_total",
            frozenset({("direction", "received"), ("backend", "tcp")})) not in got
    assert got[("pdmesh:router_instances",
                frozenset({("role", "prefill"), ("state", "unhealthy")}))] == 1
    assert got[("pdmesh:router_routing_decisions_total", frozenset(
        {("policy", "prefix_aware"), ("role", "decode"), ("reason", "cached_prefix")}))] == 1


def test_metrics_are_built_once_per_registry() -> None:
    r = CollectorRegistry()
    assert kv_transfer_metrics(r) is kv_transfer_metrics(r)
    assert router_metrics(r) is router_metrics(r)
    assert kv_transfer_metrics(r) is not kv_transfer_metrics(CollectorRegistry())


def test_no_redis_means_no_index_gauge() -> None:
    r = CollectorRegistry()
    r.register(EngineCollector("prefill", lambda: state(index_up=None)))
    assert not [k for k in samples(r) if k[0] == "pdmesh:index_up"]


def test_the_endpoint_serves_the_registry_and_refuses_a_taken_port() -> None:
    r = CollectorRegistry()
    engine_metrics("prefill", r, model_name="smol").request_finished(
        outcome="exported", prompt_tokens=3, generation_tokens=1, ttft_s=0.1, e2e_s=0.1,
        queue_s=None)
    endpoint = start_metrics_server("127.0.0.1", 0, r)
    try:
        assert endpoint.url == f"http://127.0.0.1:{endpoint.port}/metrics"
        with urllib.request.urlopen(endpoint.url, timeout=5) as resp:
            body = resp.read().decode()
        assert ('pdmesh:requests_total{model_name="smol",outcome="exported",role="prefill"} 1.0'
                in body)
        with pytest.raises(OSError, match="--metrics-port"):
            start_metrics_server("127.0.0.1", endpoint.port, r)
    finally:
        endpoint.close()


def test_a_new_registry_gets_its_own_metrics_even_at_a_dead_ones_address() -> None:
    """Metrics are built once per registry object: a registry made after another was collected
    may sit at the same address, and must not be handed the dead one's (unregistered) metrics."""
    import gc

    seen: set[int] = set()
    for _ in range(50):  # CPython reuses a freed object's address almost at once
        registry = CollectorRegistry()
        metrics = engine_metrics("decode", registry, model_name="m")
        metrics.prompt_tokens.labels("m", "decode").inc(7)
        names = {s.name for family in registry.collect() for s in family.samples}
        assert "pdmesh:prompt_tokens_total" in names
        reused = id(registry) in seen
        seen.add(id(registry))
        del registry, metrics
        gc.collect()
        if reused:
            return
    pytest.skip("no registry address was reused")
