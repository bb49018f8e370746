"""Prometheus metrics of the gateway, one registry per app, every name prefixed `pdmesh:`.

Counters count tokens (not requests) where they can, so rates are computable; latencies are
measured from monotonic timestamps in this process, as the client of the router sees them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdmesh.metrics_vllm import named_registry

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdmesh:gateway_requests", "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"], registry=r,
        )
        self.errors = Counter(
            "pdmesh:gateway_request_errors", "Requests answered with an error status",
            ["endpoint", "status"], registry=r,
        )
        self.in_flight = Gauge(
            "pdmesh:gateway_requests_in_flight", "Generation requests being served",
            ["endpoint"], registry=r,
        )
        self.ttft = Histogram(
            "pdmesh:gateway_time_to_first_token_seconds",
            "From the request arriving to its first generated text",
            ["endpoint"], buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.e2e = Histogram(
            "pdmesh:gateway_e2e_request_latency_seconds",
            "From the request arriving to its last byte", ["endpoint"],
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.prompt_tokens = Counter(
            "pdmesh:gateway_prompt_tokens", "Prompt tokens of finished requests", registry=r,
        )
        self.cached_prompt_tokens = Counter(
            "pdmesh:gateway_cached_prompt_tokens",
            "Prompt tokens served from a prefix cache", registry=r,
        )
        self.generation_tokens = Counter(
            "pdmesh:gateway_generation_tokens", "Generated tokens of finished requests",
            registry=r,
        )
        self.disconnects = Counter(
            "pdmesh:gateway_client_disconnects",
            "Requests cancelled because the HTTP client went away", ["endpoint"], registry=r,
        )

    def requests_in_flight(self) -> int:
        """Generation requests being served now, every endpoint's (vLLM's /load)."""
        return int(sum(sample.value for metric in self.in_flight.collect()
                       for sample in metric.samples))

    def render(self, names: str = "pdmesh") -> bytes:
        """This gateway's own metrics (`names`: see pdmesh/metrics_vllm.py; none of the
        gateway's is aliased today). Under `pdmesh serve` /metrics serves more: info_routes."""
        return generate_latest(named_registry(self.registry, names))
