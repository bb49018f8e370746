"""The Grafana dashboard shipped in the Helm chart queries metrics that exist.

Every `pdmesh:` name in a panel's PromQL must be a sample name some pdmesh service really
exports (the registries of pdmesh/metrics.py and gateway/metrics.py, histograms' _bucket/_sum/
_count and counters' _total included), so a renamed metric fails here and not on an operator's
empty panel. The panels named in the operator's brief must all be there.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pdmesh.gateway.metrics import GatewayMetrics
from pdmesh.metrics import (
    EngineCollector,
    EngineState,
    RouterCollector,
    RouterState,
    engine_metrics,
    kv_transfer_metrics,
    router_metrics,
)

pytestmark = pytest.mark.fast

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "pdmesh" / "dashboards" / "pdmesh.json"
METRIC = re.compile(r"pdmesh:[A-Za-z0-9_:]+")


def exported_sample_names() -> set[str]:
    """Every sample name the services export (with values filled in so all families show)."""
    r = CollectorRegistry()
    engine = engine_metrics("decode", r, model_name="m")
    engine.request_finished(outcome="stop", prompt_tokens=3, generation_tokens=2, ttft_s=0.1,
                            e2e_s=0.2, queue_s=0.01)
    engine.inter_token(0.01)
    engine.kv_load_fallback("timeout")
    kv_transfer_metrics(r).observe("received", "shm", 10, 0.01, "ok")
    kv_transfer_metrics(r).observe("received", "shm", 0, 0.0, "timeout")
    router_metrics(r)
    r.register(EngineCollector("decode", lambda: EngineState(
        num_running=1, num_waiting=0, kv_usage=0.1, num_free_blocks=1, num_total_blocks=2,
        num_pinned_blocks=0, prefix_query_tokens=1, prefix_hit_tokens=1, index_up=True),
        model_name="m"))
    r.register(RouterCollector(lambda: RouterState(
        running=0, queued=0, inflight_tokens=0, instances=[("decode", True)], index_up=True)))
    names = {s.name for family in r.collect() for s in family.samples}
    # Labelled metrics nobody touched have no samples yet; their families still name them.
    for family in r.collect():
        suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    gateway = GatewayMetrics()
    names.update(s.name for family in gateway.registry.collect() for s in family.samples)
    return names


def test_dashboard_parses_and_every_queried_metric_exists() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v.get("query", "") for v in dashboard["templating"]["list"]]
    queried = {m for e in exprs for m in METRIC.findall(e)}
    assert queried, "the dashboard queries no pdmesh metric"
    missing = sorted(queried - exported_sample_names())
    assert not missing, f"the dashboard queries metrics no service exports: {missing}"


def test_dashboard_has_the_operator_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("first token", "inter-token", "end-to-end", "throughput", "kv cache usage",
                  "prefix cache hit", "queue", "kv transfer", "routing"):
        assert topic in titles, f"no panel about {topic!r} in: {titles}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
