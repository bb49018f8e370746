"""Traces and metrics of a real mesh: router + 1 prefill + 1 decode + redis-server, 127.0.0.1.

The test plays the gateway: it sends each request with its own W3C `traceparent` and runs a
small OTLP/gRPC trace receiver that every service exports to (standard OTEL_* variables).
One request must come back as one trace whose spans from three processes link up
gateway -> router -> {admission, route, prefill -> {queue, compute}, decode -> kv_transfer
(receiver) -> kv_transfer (sender)}. Afterwards every service's /metrics is scraped and the
counters must have moved exactly as the traffic implies.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import TypeVar

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.serve import LocalMesh, MeshConfig
from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

T = TypeVar("T")
# Long enough for several full KV blocks, so the repeat hits the prefill's prefix cache.
SHARED_PREFIX = (
    "You are a meticulous assistant. Answer in one short sentence, and never add detail "
    "that was not asked for. Here is some background you may need: the river flows north "
    "through three towns, each with a stone bridge built in a different century. "
)


@dataclass(frozen=True)
class SpanRecord:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, object]


def _value(v: object) -> object:
    which = v.WhichOneof("value")  # type: ignore[attr-defined]
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]  # type: ignore[attr-defined]
    return getattr(v, which) if which else None


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC collector keeping every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []
        self._cond = threading.Condition()

    def Export(self, request, context):
        records = []
        for rs in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    records.append(SpanRecord(
                        service=service, name=s.name, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                        kind=s.kind, attributes={a.key: _value(a.value) for a in s.attributes},
                    ))
        with self._cond:
            self.spans.extend(records)
            self._cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate: Callable[[list[SpanRecord]], bool], timeout_s: float,
                 what: str) -> list[SpanRecord]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(self.spans):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    names = sorted((s.service, s.name) for s in self.spans)
                    raise AssertionError(f"timed out waiting for {what}; have {names}")
                self._cond.wait(remaining)
            return list(self.spans)


@dataclass
class Observed:
    mesh: LocalMesh
    receiver: TraceReceiver

    def generate(self, prompt: str, traceparent: str = "", max_tokens: int = 4,
                 stream: bool = True) -> list[router_pb2.GenerateResponse]:
        request = router_pb2.GenerateRequest(
            text=prompt, stream=stream,
            # ignore_eos: a first token that ends the request would leave nothing to decode
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                               ignore_eos=True),
        )
        metadata = (("traceparent", traceparent),) if traceparent else ()
        with grpc.insecure_channel(self.mesh.router_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            return list(stub.Generate(request, timeout=120, metadata=metadata))

    def scrape(self, child: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """{(sample name, sorted labels): value} of one child's /metrics."""
        url = self.mesh.metrics_urls()[child]
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            assert family.name.startswith("pdmesh:"), f"{child}: {family.name} lacks the prefix"
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(
        value for (sample, sample_labels), value in samples.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


def wait_until(predicate: Callable[[], T], what: str, timeout_s: float = 30.0) -> T:
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last: {last!r}")


@pytest.fixture(scope="module")
def observed() -> Iterator[Observed]:
    receiver = TraceReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_BSP_SCHEDULE_DELAY="50",
        OMP_NUM_THREADS="1",
    )
    config = MeshConfig(
        num_prefill=1, num_decode=1, kv_cache_memory="96MiB", gateway_port=0,
        local_prefill_threshold=0,  # always prefill remotely: every hop is exercised
    )
    mesh = LocalMesh(config, env=env)
    try:
        mesh.start()
        yield Observed(mesh, receiver)
    finally:
        mesh.stop()
        server.stop(grace=None)


def new_traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def test_one_request_is_one_trace_across_every_hop(observed: Observed) -> None:
    traceparent, trace_id, gateway_span = new_traceparent()
    responses = observed.generate(SHARED_PREFIX + "Which way does the river flow?", traceparent)
    assert responses[-1].HasField("result")
    request_id = responses[-1].result.request_id
    expected = {
        ("pdmesh-router", "pdmesh.router.generate"), ("pdmesh-router", "pdmesh.router.admission"),
        ("pdmesh-router", "pdmesh.router.route"), ("pdmesh-prefill", "pdmesh.prefill"),
        ("pdmesh-prefill", "pdmesh.prefill.queue"), ("pdmesh-prefill", "pdmesh.prefill.compute"),
        ("pdmesh-prefill", "pdmesh.kv_transfer"), ("pdmesh-decode", "pdmesh.decode"),
        ("pdmesh-decode", "pdmesh.kv_transfer"),
    }

    def of_trace(spans: list[SpanRecord]) -> list[SpanRecord]:
        return [s for s in spans if s.trace_id == trace_id]

    spans = of_trace(observed.receiver.wait_for(
        lambda all_: expected <= {(s.service, s.name) for s in of_trace(all_)},
        timeout_s=30, what="every span of the request",
    ))
    by_key = {(s.service, s.name): s for s in spans}
    assert len(spans) == len(expected), sorted((s.service, s.name) for s in spans)
    # Every span carrying this request's id is in this one trace.
    others = [s for s in observed.receiver.spans
              if s.attributes.get("pdmesh.request_id") == request_id and s.trace_id != trace_id]
    assert not others

    def parent(service: str, name: str) -> str:
        return by_key[(service, name)].parent_id

    generate = by_key[("pdmesh-router", "pdmesh.router.generate")]
    prefill = by_key[("pdmesh-prefill", "pdmesh.prefill")]
    decode = by_key[("pdmesh-decode", "pdmesh.decode")]
    kv_recv = by_key[("pdmesh-decode", "pdmesh.kv_transfer")]
    kv_send = by_key[("pdmesh-prefill", "pdmesh.kv_transfer")]
    assert generate.parent_id == gateway_span
    assert parent("pdmesh-router", "pdmesh.router.admission") == generate.span_id
    assert parent("pdmesh-router", "pdmesh.router.route") == generate.span_id
    assert prefill.parent_id == generate.span_id
    assert decode.parent_id == generate.span_id
    assert parent("pdmesh-prefill", "pdmesh.prefill.queue") == prefill.span_id
    assert parent("pdmesh-prefill", "pdmesh.prefill.compute") == prefill.span_id
    assert kv_recv.parent_id == decode.span_id
    assert kv_send.parent_id == kv_recv.span_id

    usage = responses[-1].result.usage
    assert generate.attributes["gen_ai.request.model"] == "smollm2"
    assert generate.attributes["gen_ai.request.max_tokens"] == 4
    assert generate.attributes["gen_ai.request.temperature"] == 0.0
    assert generate.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert generate.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens == 4
    assert generate.attributes["gen_ai.response.finish_reasons"] == ["length"]
    route = by_key[("pdmesh-router", "pdmesh.router.route")].attributes
    assert route["pdmesh.route.policy"] == "prefix_aware"
    assert route["pdmesh.route.prefill_placement"] == "remote"
    assert route["pdmesh.route.decode.instance_id"] == decode.attributes["pdmesh.instance_id"]
    assert route["pdmesh.route.prefill.instance_id"] == prefill.attributes["pdmesh.instance_id"]
    assert len(route["pdmesh.route.decode.candidate_costs"]) == 1
    assert prefill.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert decode.attributes["gen_ai.usage.output_tokens"] == 3  # the first came from prefill
    assert decode.attributes["pdmesh.decode.ttft_ms"] > 0
    for kv in (kv_recv, kv_send):
        assert kv.attributes["pdmesh.kv.outcome"] == "ok"
        assert kv.attributes["pdmesh.kv.bytes"] > 0
        assert kv.attributes["pdmesh.kv.backend"] == kv_recv.attributes["pdmesh.kv.backend"]
    assert kv_recv.attributes["pdmesh.kv.bytes"] == kv_send.attributes["pdmesh.kv.bytes"]


def test_requests_without_a_caller_trace_start_their_own(observed: Observed) -> None:
    responses = observed.generate("Name a primary color.", max_tokens=2)
    request_id = responses[-1].result.request_id

    def mine(spans: list[SpanRecord]) -> list[SpanRecord]:
        return [s for s in spans if s.attributes.get("pdmesh.request_id") == request_id]

    spans = mine(observed.receiver.wait_for(
        lambda all_: {s.name for s in mine(all_)} >= {
            "pdmesh.router.generate", "pdmesh.prefill", "pdmesh.decode", "pdmesh.kv_transfer"},
        timeout_s=30, what="the untraced request's spans",
    ))
    assert len({s.trace_id for s in spans}) == 1
    root = next(s for s in spans if s.name == "pdmesh.router.generate")
    assert root.parent_id == ""


def test_metrics_move_as_the_traffic_implies(observed: Observed) -> None:
    names = {"router", "prefill-0", "decode-0", "gateway"}  # scrape asserts the prefix
    assert set(observed.mesh.metrics_urls()) == names
    before = {name: observed.scrape(name) for name in names}

    first = observed.generate(SHARED_PREFIX + "How many towns are there?")
    after_first = observed.scrape("prefill-0")
    second = observed.generate(SHARED_PREFIX + "What is each bridge made of?")
    assert first[-1].HasField("result") and second[-1].HasField("result")
    cached = second[-1].result.usage.cached_prompt_tokens
    assert cached >= 32, "the repeated prefix should be cached on the prefill instance"

    prefill = wait_until(
        lambda: (s := observed.scrape("prefill-0"))
        and metric(s, "pdmesh:kv_transfers_total", direction="sent")
        >= metric(before["prefill-0"], "pdmesh:kv_transfers_total", direction="sent") + 2 and s,
        "the prefill's transfers to be recorded",
    )
    decode = observed.scrape("decode-0")
    router = observed.scrape("router")

    def grew(samples: dict, name: str, who: str, **labels: str) -> float:
        return metric(samples, name, **labels) - metric(before[who], name, **labels)

    # Prefix cache (tokens): the second request's hits are exactly its cached prompt tokens.
    hits = "pdmesh:prefix_cache_hits_total"
    assert metric(prefill, hits) - metric(after_first, hits) == cached
    assert grew(prefill, "pdmesh:prefix_cache_queries_total", "prefill-0") >= 2 * cached
    # KV moved: bytes out of prefill == bytes into decode, both > 0.
    sent = grew(prefill, "pdmesh:kv_transfer_bytes_total", "prefill-0", direction="sent")
    received = grew(decode, "pdmesh:kv_transfer_bytes_total", "decode-0", direction="received")
    assert sent > 0 and sent == received
    assert grew(decode, "pdmesh:kv_transfer_duration_seconds_count", "decode-0") == 2
    assert grew(prefill, "pdmesh:kv_transfer_failures_total", "prefill-0") == 0
    # Routing: every request chose a decode and a prefill instance, by prefix-aware policy.
    for role in ("decode", "prefill"):
        assert grew(router, "pdmesh:router_routing_decisions_total", "router",
                    policy="prefix_aware", role=role) == 2
    assert grew(router, "pdmesh:router_prefill_placements_total", "router",
                placement="remote") == 2
    assert grew(router, "pdmesh:router_requests_total", "router", code="OK") == 2
    assert grew(router, "pdmesh:router_time_to_first_token_seconds_count", "router") == 2
    both_cached = cached + first[-1].result.usage.cached_prompt_tokens
    assert grew(router, "pdmesh:router_cached_prompt_tokens_total", "router") == both_cached
    assert metric(router, "pdmesh:index_up") == 1
    assert metric(router, "pdmesh:router_instances", role="decode", state="healthy") == 1
    # Engine-side latency histograms and gauges.
    assert grew(decode, "pdmesh:time_to_first_token_seconds_count", "decode-0") == 2
    assert grew(decode, "pdmesh:time_per_output_token_seconds_count", "decode-0") == 2
    assert grew(prefill, "pdmesh:request_queue_time_seconds_count", "prefill-0") == 2
    assert grew(prefill, "pdmesh:requests_total", "prefill-0", outcome="exported") == 2
    assert metric(decode, "pdmesh:kv_cache_total_blocks") > 0
    # The cores' step counters (across the core process boundary): both engines computed.
    for samples, who in ((prefill, "prefill-0"), (decode, "decode-0")):
        assert grew(samples, "pdmesh:engine_steps_total", who) >= 2
        assert grew(samples, "pdmesh:engine_step_seconds_total", who) > 0
    # Prefill computes each prompt's uncached part; decode the tokens after the first.
    prompts = sum(r[-1].result.usage.prompt_tokens for r in (first, second))
    assert grew(prefill, "pdmesh:engine_scheduled_tokens_total", "prefill-0") <= prompts
    assert metric(prefill, "pdmesh:index_up") == 1


def test_an_unstreamed_request_costs_the_decode_two_messages(observed: Observed) -> None:
    """stream=false: the router asks the engines for a delta per 64 tokens (its resume state
    is all they feed), so a 24-token answer is the decode's first output and its last, where
    a streamed one is a delta per token; the answers are the same."""
    itl = "pdmesh:inter_token_latency_seconds_count"  # one per delta after a request's first
    prompt = SHARED_PREFIX + "Which bridge is the oldest?"
    before = metric(observed.scrape("decode-0"), itl)
    whole = observed.generate(prompt, max_tokens=24, stream=False)
    after_whole = metric(observed.scrape("decode-0"), itl)
    streamed = observed.generate(prompt, max_tokens=24)
    after_streamed = metric(observed.scrape("decode-0"), itl)
    assert after_whole - before <= 1
    assert after_streamed - after_whole > 1
    assert [r.delta.text for r in whole if r.HasField("delta")] == \
        ["".join(r.delta.text for r in streamed if r.HasField("delta"))]
    assert whole[-1].result.usage.completion_tokens == 24


def test_admission_rejections_are_counted_by_reason(observed: Observed) -> None:
    before = metric(observed.scrape("router"), "pdmesh:router_admission_rejections_total",
                    reason="invalid_argument")
    request = router_pb2.GenerateRequest(
        text="hello", sampling=common_pb2.SamplingParams(temperature=-1.0, max_tokens=2))
    with grpc.insecure_channel(observed.mesh.router_address) as channel, \
            pytest.raises(grpc.RpcError) as err:
        list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    router = observed.scrape("router")
    assert metric(router, "pdmesh:router_admission_rejections_total",
                  reason="invalid_argument") == before + 1
    assert metric(router, "pdmesh:router_requests_total", code="INVALID_ARGUMENT") >= 1


def test_gateway_http_request_roots_the_trace(observed: Observed) -> None:
    """HTTP traceparent -> gateway span -> router gRPC metadata -> the rest of the tree."""
    import httpx

    traceparent, trace_id, client_span = new_traceparent()
    body = {"model": "smollm2", "prompt": SHARED_PREFIX + "Where is the bridge?",
            "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert observed.mesh.gateway_url is not None
    resp = httpx.post(f"{observed.mesh.gateway_url}/completions", json=body,
                      headers={"traceparent": traceparent}, timeout=120)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]

    def keys(spans: list[SpanRecord]) -> set[tuple[str, str]]:
        return {(s.service, s.name) for s in spans if s.trace_id == trace_id}

    wanted = {("pdmesh-gateway", "pdmesh.gateway.request"),
              ("pdmesh-router", "pdmesh.router.generate"), ("pdmesh-decode", "pdmesh.decode")}
    spans = [s for s in observed.receiver.wait_for(
        lambda all_: wanted <= keys(all_), timeout_s=30, what="the gateway's trace")
        if s.trace_id == trace_id]
    by_key = {(s.service, s.name): s for s in spans}
    gateway = by_key[("pdmesh-gateway", "pdmesh.gateway.request")]
    assert gateway.parent_id == client_span
    assert by_key[("pdmesh-router", "pdmesh.router.generate")].parent_id == gateway.span_id
    assert gateway.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert gateway.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 3
