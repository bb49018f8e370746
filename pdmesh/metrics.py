"""Prometheus metrics of the pdmesh services: one catalog, one prefix (`pdmesh:`), one endpoint.

Every process keeps its metrics in one `CollectorRegistry` (`process_registry()`), served as
text on `http://<host>:<port>/metrics` by `start_metrics_server`. Only pdmesh metrics are in
it, so every exported name starts with `pdmesh:` (unless PDMESH_METRICS_NAMES=vllm adds vLLM's
names at exposition: pdmesh/metrics_vllm.py). Under `pdmesh serve` the gateway's /metrics
also serves every other process's (gateway/metrics_federation.py).

Two kinds of metric live here:

* *observed* ones (histograms, event counters) that the code updates as things happen — the
  `*Metrics` dataclasses, created once per registry (`engine_metrics()`, `router_metrics()`,
  `kv_transfer_metrics()`);
* *scraped* ones (gauges of live state, counters the engine already keeps cumulatively) read at
  scrape time by a collector (`EngineCollector`, `RouterCollector`), so the hot paths pay
  nothing for them and the numbers can never drift from the engine's own.

Units are in the names (`_seconds`, `_bytes`, `_ratio`); token counters count tokens.
Label values are low-cardinality by construction (roles, policies, reasons from fixed sets).
See docs/OBSERVABILITY.md for the full list.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdmesh.metrics_vllm import metrics_names, named_registry

logger = logging.getLogger(__name__)

PREFIX = "pdmesh:"
LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
TOKEN_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
)
TRANSFER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                      2.5, 5.0, 10.0, 30.0)
REQUEST_TOKENS_BUCKETS = (*(m * 10**e for e in range(6) for m in (1, 2, 5)), 1_000_000)
"""Tokens per request: vLLM's 1-2-5 series (vLLM stops it at the model's length; here at 1M)."""

T = TypeVar("T")
_lock = threading.Lock()
_process_registry: CollectorRegistry | None = None
_per_registry: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Any]] = (
    weakref.WeakKeyDictionary())
"""Each registry's metrics by kind, for as long as the registry lives: keyed by the object, not
its `id()`, which a registry created after another was collected may reuse."""


def metric_name(name: str) -> str:
    """`name` with the one pdmesh prefix."""
    return name if name.startswith(PREFIX) else PREFIX + name


def process_registry() -> CollectorRegistry:
    """The registry this process serves on /metrics (created on first use)."""
    global _process_registry
    with _lock:
        if _process_registry is None:
            _process_registry = CollectorRegistry(auto_describe=True)
        return _process_registry


def _once(kind: str, registry: CollectorRegistry | None, build: Callable[[CollectorRegistry], T]
          ) -> T:
    """One `build(registry)` per registry and kind: metrics cannot be registered twice."""
    registry = registry or process_registry()
    with _lock:
        kinds = _per_registry.setdefault(registry, {})
        if kind not in kinds:
            kinds[kind] = build(registry)
        return kinds[kind]


# -- KV transfer (both ends) -----------------------------------------------------------------------
@dataclass(frozen=True)
class KVTransferMetrics:
    """Labels: direction = sent (prefill, serving a pull) | received (decode, pulling)."""

    bytes: Counter
    duration: Histogram
    transfers: Counter
    failures: Counter

    def observe(self, direction: str, backend: str, nbytes: int, seconds: float,
                outcome: str) -> None:
        """Record one finished transfer; bytes and duration only for successful ones."""
        self.transfers.labels(direction, backend, outcome).inc()
        if outcome == "ok":
            self.bytes.labels(direction, backend).inc(nbytes)
            self.duration.labels(direction, backend).observe(seconds)
        else:
            self.failures.labels(direction, outcome).inc()


def _build_kv(r: CollectorRegistry) -> KVTransferMetrics:
    return KVTransferMetrics(
        bytes=Counter(metric_name("kv_transfer_bytes"),
                      "KV cache bytes moved by completed transfers",
                      ["direction", "backend"], registry=r),
        duration=Histogram(metric_name("kv_transfer_duration_seconds"),
                           "Duration of completed KV transfers (start to acknowledgement)",
                           ["direction", "backend"], buckets=TRANSFER_BUCKETS_S, registry=r),
        transfers=Counter(metric_name("kv_transfers"),
                          "KV transfers that ended, by outcome",
                          ["direction", "backend", "outcome"], registry=r),
        failures=Counter(metric_name("kv_transfer_failures"),
                         "KV transfers that did not complete, by reason",
                         ["direction", "reason"], registry=r),
    )


def kv_transfer_metrics(registry: CollectorRegistry | None = None) -> KVTransferMetrics:
    return _once("kv_transfer", registry, _build_kv)


# -- engine services (prefill, decode, colocated) --------------------------------------------------
def failure_outcome(exc: BaseException) -> str:
    """The `outcome` label of a request that ended by an exception: a caller that went away
    (client disconnect, router cancel: the handler task is cancelled or the response stream
    closed) is "cancelled", not a fault of this service; anything else is "error"."""
    return "cancelled" if isinstance(exc, asyncio.CancelledError | GeneratorExit) else "error"


@dataclass(frozen=True)
class EngineMetrics:
    """Per-request observations of one engine service; every metric has `model_name` (the
    served name, as vLLM labels its metrics) and `role` labels, in that order."""

    role: str
    model_name: str
    ttft: Histogram
    tpot: Histogram
    e2e: Histogram
    queue_time: Histogram
    requests: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    kv_load_fallbacks: Counter
    itl: Histogram
    kv_blocks_loaded: Counter
    kv_stream_blocks: Counter
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    peer_prefix_blocks: Counter
    peer_prefix_bytes: Counter
    peer_prefix_fallbacks: Counter

    def prefix_lent(self, blocks: int) -> None:
        """This instance lent `blocks` cached prefix blocks to a peer (KVPeer.LendPrefix)."""
        self.peer_prefix_blocks.labels(self.model_name, self.role, "lent", "").inc(blocks)

    def prefix_pulled(self, peer: str, *, pulled: int, reused: int, nbytes: int) -> None:
        """A lent prefix placed here: blocks pulled from `peer` (prefill tokens not
        computed) and blocks this instance's own prefix cache already held."""
        self.peer_prefix_blocks.labels(self.model_name, self.role, "pulled", peer).inc(pulled)
        self.peer_prefix_blocks.labels(self.model_name, self.role, "reused", peer).inc(reused)
        self.peer_prefix_bytes.labels(self.model_name, self.role, peer).inc(nbytes)

    def prefix_fallback(self, reason: str) -> None:
        """A lent prefix could not be pulled; the prompt was computed here whole."""
        self.peer_prefix_fallbacks.labels(self.model_name, self.role, reason).inc()

    def kv_load_fallback(self, reason: str) -> None:
        """A KV pull failed and this instance prefilled the prompt itself (`reason`: the
        transfer failure's label, e.g. timeout, expired, checksum, sender_unavailable)."""
        self.kv_load_fallbacks.labels(self.model_name, self.role, reason).inc()

    def kv_blocks(self, *, pulled: int, reused: int) -> None:
        """A prompt's KV placed by this instance's core: blocks pulled from the prefill
        instance, and leading blocks its own prefix cache already held (not moved)."""
        self.kv_blocks_loaded.labels(self.model_name, self.role, "pulled").inc(pulled)
        self.kv_blocks_loaded.labels(self.model_name, self.role, "reused").inc(reused)

    def kv_stream(self, *, before_seal: int, after_seal: int) -> None:
        """A streamed pull landed: blocks pulled while the prefill still computed the
        prompt (hidden behind its chunks), and after it ended."""
        self.kv_stream_blocks.labels(self.model_name, self.role, "before_seal").inc(before_seal)
        self.kv_stream_blocks.labels(self.model_name, self.role, "after_seal").inc(after_seal)

    def inter_token(self, gap_s: float) -> None:
        """One output delta `gap_s` after the request's previous one (vLLM's ITL)."""
        self.itl.labels(self.model_name, self.role).observe(gap_s)

    def request_finished(
        self, *, outcome: str, prompt_tokens: int, generation_tokens: int,
        ttft_s: float | None, e2e_s: float, queue_s: float | None,
    ) -> None:
        """Record one request this service finished serving (`outcome`: a finish reason,
        "exported" for a prefill handed to decode, or "error"/"cancelled")."""
        who = (self.model_name, self.role)
        self.requests.labels(*who, outcome).inc()
        self.prompt_tokens.labels(*who).inc(prompt_tokens)
        self.generation_tokens.labels(*who).inc(generation_tokens)
        self.request_prompt_tokens.labels(*who).observe(prompt_tokens)
        self.request_generation_tokens.labels(*who).observe(generation_tokens)
        self.e2e.labels(*who).observe(e2e_s)
        if ttft_s is not None:
            self.ttft.labels(*who).observe(ttft_s)
            if generation_tokens > 1:
                self.tpot.labels(*who).observe((e2e_s - ttft_s) / (generation_tokens - 1))
        if queue_s is not None:
            self.queue_time.labels(*who).observe(queue_s)


ENGINE_LABELS = ["model_name", "role"]


def _build_engine(r: CollectorRegistry, role: str, model_name: str) -> EngineMetrics:
    labels = ENGINE_LABELS
    return EngineMetrics(
        role=role,
        model_name=model_name,
        ttft=Histogram(metric_name("time_to_first_token_seconds"),
                       "Request received by this service to its first output token",
                       labels, buckets=LATENCY_BUCKETS_S, registry=r),
        tpot=Histogram(metric_name("time_per_output_token_seconds"),
                       "(e2e - ttft) / (output tokens - 1) of each finished request",
                       labels, buckets=TOKEN_LATENCY_BUCKETS_S, registry=r),
        e2e=Histogram(metric_name("e2e_request_latency_seconds"),
                      "Request received by this service to its last output",
                      labels, buckets=LATENCY_BUCKETS_S, registry=r),
        queue_time=Histogram(metric_name("request_queue_time_seconds"),
                             "Time a request waited in the engine before first scheduled",
                             labels, buckets=LATENCY_BUCKETS_S, registry=r),
        requests=Counter(metric_name("requests"), "Requests this service finished, by outcome",
                         [*labels, "outcome"], registry=r),
        prompt_tokens=Counter(metric_name("prompt_tokens"), "Prompt tokens of finished requests",
                              labels, registry=r),
        generation_tokens=Counter(metric_name("generation_tokens"),
                                  "Tokens generated by this service", labels, registry=r),
        kv_load_fallbacks=Counter(metric_name("kv_load_fallbacks"),
                                  "Requests whose KV pull failed and that this instance "
                                  "prefilled itself, by the pull's failure reason",
                                  [*labels, "reason"], registry=r),
        itl=Histogram(metric_name("inter_token_latency_seconds"),
                      "Time between two consecutive output deltas of one request",
                      labels, buckets=TOKEN_LATENCY_BUCKETS_S, registry=r),
        kv_blocks_loaded=Counter(metric_name("kv_blocks_loaded"),
                                 "Prompt KV blocks of remote prefills placed here: pulled from "
                                 "the prefill instance, or reused from this prefix cache",
                                 [*labels, "source"], registry=r),
        kv_stream_blocks=Counter(metric_name("kv_stream_blocks"),
                                 "Prompt KV blocks pulled from streamed prefills (PrefillStream), "
                                 "by whether the pull started before the prefill ended",
                                 [*labels, "phase"], registry=r),
        request_prompt_tokens=Histogram(metric_name("request_prompt_tokens"),
                                        "Prompt tokens of each finished request",
                                        labels, buckets=REQUEST_TOKENS_BUCKETS, registry=r),
        request_generation_tokens=Histogram(metric_name("request_generation_tokens"),
                                            "Tokens this service generated for each finished "
                                            "request", labels, buckets=REQUEST_TOKENS_BUCKETS,
                                            registry=r),
        peer_prefix_blocks=Counter(metric_name("kv_peer_prefix_blocks"),
                                   "Cached prefix blocks moved between peers (cluster-wide "
                                   "prefix caching): lent by this instance, pulled from a peer "
                                   "instead of computed, or already held here",
                                   [*labels, "direction", "peer"], registry=r),
        peer_prefix_bytes=Counter(metric_name("kv_peer_prefix_bytes"),
                                  "Bytes of lent prefix blocks pulled from each peer",
                                  [*labels, "peer"], registry=r),
        peer_prefix_fallbacks=Counter(metric_name("kv_peer_prefix_fallbacks"),
                                      "Lent prefixes that could not be pulled (the prompt was "
                                      "computed whole), by reason", [*labels, "reason"],
                                      registry=r),
    )


def engine_metrics(role: str, registry: CollectorRegistry | None = None,
                   model_name: str = "") -> EngineMetrics:
    """The role's metrics in `registry`; `model_name` is fixed by the first call (the engine
    process passes its served name; later callers get the same object)."""
    return _once(f"engine:{role}", registry, lambda r: _build_engine(r, role, model_name))


@dataclass(frozen=True)
class EngineState:
    """What an engine process reports at scrape time (read from its load snapshot)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_pinned_blocks: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    index_up: bool | None  # None: no Redis configured
    num_steps: int = 0
    step_seconds: float = 0.0
    scheduled_tokens: int = 0
    num_preemptions: int = 0
    num_predicted_steps: int = 0
    predicted_step_seconds: float = 0.0
    predicted_steps_actual_seconds: float = 0.0
    itl_target_seconds: float = 0.0
    model_prefill_tokens_per_s: float = 0.0
    selfcheck_fallbacks: dict[str, bool] = field(default_factory=dict)
    """Per feature of the engine core's start-up self-check: True where it fell back."""
    # The KV offload tiers (engine/core/kv_offload.py; block_bytes 0 = no tier): as in the
    # core's load snapshot (engine/core_types.py EngineLoadSnapshot.kv_offload_*).
    kv_offload_block_bytes: int = 0
    kv_offload_host_blocks: int = 0
    kv_offload_disk_blocks: int = 0
    kv_offload_host_saved_blocks: int = 0
    kv_offload_disk_saved_blocks: int = 0
    kv_offload_host_restored_blocks: int = 0
    kv_offload_disk_restored_blocks: int = 0
    kv_offload_restore_failures: int = 0
    kv_offload_restored_tokens: int = 0


def _offload_metrics(s: EngineState, role: list[str]) -> Iterator[Metric]:
    """The KV offload tiers' families, by medium (host, disk)."""
    labels = [*ENGINE_LABELS, "medium"]
    held = GaugeMetricFamily(metric_name("kv_offload_blocks"), "KV blocks held in the "
                             "offload tier (engine/core/kv_offload.py)", labels=labels)
    saved = CounterMetricFamily(metric_name("kv_offload_saved_blocks"), "KV blocks copied "
                                "into the tier: evicted from the paged cache (host) or "
                                "spilled from the host tier (disk)", labels=labels)
    saved_bytes = CounterMetricFamily(metric_name("kv_offload_saved_bytes"), "Bytes of the "
                                      "blocks copied into the tier", labels=labels)
    restored = CounterMetricFamily(metric_name("kv_offload_restored_blocks"), "KV blocks "
                                   "copied back from the tier into the paged cache on a prefix "
                                   "hit (not recomputed)", labels=labels)
    restored_bytes = CounterMetricFamily(metric_name("kv_offload_restored_bytes"), "Bytes of "
                                         "the blocks restored from the tier", labels=labels)
    for medium, blocks, n_saved, n_restored in (
            ("host", s.kv_offload_host_blocks, s.kv_offload_host_saved_blocks,
             s.kv_offload_host_restored_blocks),
            ("disk", s.kv_offload_disk_blocks, s.kv_offload_disk_saved_blocks,
             s.kv_offload_disk_restored_blocks)):
        held.add_metric([*role, medium], blocks)
        saved.add_metric([*role, medium], n_saved)
        saved_bytes.add_metric([*role, medium], n_saved * s.kv_offload_block_bytes)
        restored.add_metric([*role, medium], n_restored)
        restored_bytes.add_metric([*role, medium], n_restored * s.kv_offload_block_bytes)
    yield from (held, saved, saved_bytes, restored, restored_bytes)
    failures = CounterMetricFamily(metric_name("kv_offload_restore_failures"), "Restores "
                                   "refused (checksum mismatch, unreadable file): recomputed "
                                   "instead", labels=ENGINE_LABELS)
    failures.add_metric(role, s.kv_offload_restore_failures)
    tokens = CounterMetricFamily(metric_name("kv_offload_prefill_tokens_saved"), "Prompt "
                                 "tokens restored from the offload tier instead of "
                                 "recomputed", labels=ENGINE_LABELS)
    tokens.add_metric(role, s.kv_offload_restored_tokens)
    yield from (failures, tokens)


class EngineCollector:
    """Scrape-time gauges and cumulative counters of one engine process."""

    def __init__(self, role: str, state: Callable[[], EngineState],
                 model_name: str = "") -> None:
        self.role = role
        self.model_name = model_name
        self._state = state

    def describe(self) -> list[Metric]:
        return []  # names are checked by tests; skip the registry's duplicate bookkeeping

    def collect(self) -> Iterator[Metric]:
        s = self._state()
        role = [self.model_name, self.role]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric_name(name), doc, labels=ENGINE_LABELS)
            g.add_metric(role, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric_name(name), doc, labels=ENGINE_LABELS)
            c.add_metric(role, value)
            return c

        yield gauge("num_requests_running", "Requests in the engine's running batch",
                    s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled", s.num_waiting)
        yield gauge("kv_cache_usage_ratio", "Fraction of KV blocks in use (0..1)", s.kv_usage)
        yield gauge("kv_cache_free_blocks", "KV blocks free (cached or empty)", s.num_free_blocks)
        yield gauge("kv_cache_total_blocks", "KV blocks in the paged cache", s.num_total_blocks)
        yield gauge("kv_cache_pinned_blocks", "KV blocks pinned for a transfer to decode",
                    s.num_pinned_blocks)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                      s.prefix_query_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache",
                      s.prefix_hit_tokens)
        yield counter("engine_steps", "Steps the engine core ran (one batched forward each)",
                      s.num_steps)
        yield counter("engine_step_seconds", "Wall time the engine core spent inside steps; "
                      "its rate is the fraction of time the engine computes", s.step_seconds)
        yield counter("engine_scheduled_tokens", "Tokens the engine's steps computed (prompt "
                      "chunks and decode tokens)", s.scheduled_tokens)
        yield counter("num_preemptions", "Sequences preempted (their KV freed, recomputed "
                      "later) for lack of KV blocks", s.num_preemptions)
        yield counter("engine_predicted_steps", "Steps the step-cost model predicted "
                      "(engine/scheduling/step_cost.py)", s.num_predicted_steps)
        yield counter("engine_step_predicted_seconds", "The step-cost model's predicted time "
                      "of the steps it predicted; against engine_step_predicted_actual_seconds "
                      "it says how far off the model is", s.predicted_step_seconds)
        yield counter("engine_step_predicted_actual_seconds", "Actual wall time of the steps "
                      "the step-cost model predicted", s.predicted_steps_actual_seconds)
        yield gauge("engine_itl_target_seconds", "The step time the scheduler kept the last "
                    "step with running streams to (--itl-target-ms, "
                    "engine/scheduling/step_budget.py); 0 before any", s.itl_target_seconds)
        yield gauge("engine_model_prefill_tokens_per_second", "Prompt tokens per second the "
                    "step-cost model predicts in full chunks (max_num_batched_tokens at "
                    "context 0); the router's queueing-delay rate; 0 before it has fitted",
                    s.model_prefill_tokens_per_s)
        if s.selfcheck_fallbacks:
            fallback = GaugeMetricFamily(
                metric_name("engine_selfcheck_fallback"),
                "1 where the engine core's start-up self-check failed and the feature is off "
                "(served by the reference path instead), 0 where it passed "
                "(engine/worker/selfcheck.py)", labels=[*ENGINE_LABELS, "feature"])
            for feature, off in s.selfcheck_fallbacks.items():
                fallback.add_metric([*role, feature], 1.0 if off else 0.0)
            yield fallback
        if s.kv_offload_block_bytes:
            yield from _offload_metrics(s, role)
        if s.index_up is not None:
            yield gauge("index_up", "1 while registered in the Redis prefix index and Redis "
                        "answers, 0 while unregistered or Redis is unreachable",
                        1.0 if s.index_up else 0.0)


# -- router ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterMetrics:
    ttft: Histogram
    tpot: Histogram
    e2e: Histogram
    queue_time: Histogram
    tokenize_wait: Histogram
    requests: Counter
    prompt_tokens: Counter
    cached_prompt_tokens: Counter
    generation_tokens: Counter
    routing_decisions: Counter
    prefill_placements: Counter
    admission_rejections: Counter
    index_lookups: Counter
    index_lookup_duration: Histogram
    reroutes: Counter
    migrations: Counter
    goodput_requests: Counter
    prefix_prediction_error: Histogram
    prefix_predictions: Counter
    prefix_republish_asks: Counter
    peer_prefix_offers: Counter
    peer_prefix_tokens: Counter


PREFIX_ERROR_BUCKETS_TOKENS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""|predicted - reported| cached prompt tokens; 0 is an exact prediction."""


def _build_router(r: CollectorRegistry) -> RouterMetrics:
    return RouterMetrics(
        ttft=Histogram(metric_name("router_time_to_first_token_seconds"),
                       "Request received by the router to the first token sent back",
                       buckets=LATENCY_BUCKETS_S, registry=r),
        tpot=Histogram(metric_name("router_time_per_output_token_seconds"),
                       "(e2e - ttft) / (output tokens - 1), as the router streams them",
                       buckets=TOKEN_LATENCY_BUCKETS_S, registry=r),
        e2e=Histogram(metric_name("router_e2e_request_latency_seconds"),
                      "Request received by the router to its final message",
                      buckets=LATENCY_BUCKETS_S, registry=r),
        queue_time=Histogram(metric_name("router_request_queue_time_seconds"),
                             "Time a request waited for admission",
                             buckets=LATENCY_BUCKETS_S, registry=r),
        tokenize_wait=Histogram(metric_name("router_tokenize_wait_seconds"),
                                "Time a prompt waited for a tokenizer thread, by lane (short; "
                                "large: big prompts, which leave one thread free)",
                                ["lane"], buckets=LATENCY_BUCKETS_S, registry=r),
        requests=Counter(metric_name("router_requests"),
                         "Generate calls answered, by gRPC status code", ["code"], registry=r),
        prompt_tokens=Counter(metric_name("router_prompt_tokens"),
                              "Prompt tokens of completed requests", registry=r),
        cached_prompt_tokens=Counter(metric_name("router_cached_prompt_tokens"),
                                     "Prompt tokens served from a prefix cache", registry=r),
        generation_tokens=Counter(metric_name("router_generation_tokens"),
                                  "Tokens streamed back to clients", registry=r),
        routing_decisions=Counter(
            metric_name("router_routing_decisions"),
            "Instance choices, by policy, role chosen for, and why",
            ["policy", "role", "reason"], registry=r),
        prefill_placements=Counter(
            metric_name("router_prefill_placements"),
            "Where prompts were prefilled: remote (a prefill instance) or local (on decode)",
            ["placement"], registry=r),
        admission_rejections=Counter(
            metric_name("router_admission_rejections"),
            "Requests refused before routing, by reason", ["reason"], registry=r),
        index_lookups=Counter(
            metric_name("router_index_lookups"),
            "Prefix index (Redis) lookups, by outcome (ok, error)", ["outcome"], registry=r),
        index_lookup_duration=Histogram(
            metric_name("router_index_lookup_duration_seconds"),
            "Duration of prefix index (Redis) lookups", buckets=TRANSFER_BUCKETS_S, registry=r),
        reroutes=Counter(
            metric_name("router_reroutes"),
            "Prefill or Decode calls sent to another instance because the first could not be "
            "reached, by role and reason (unreachable, connection_lost, shutting_down)",
            ["role", "reason"], registry=r),
        migrations=Counter(
            metric_name("router_migrations"),
            "Decode streams that broke before the request finished and were resumed on "
            "another decode instance, by reason (connection_lost, unavailable, internal, "
            "no_result, ...)",
            ["reason"], registry=r),
        goodput_requests=Counter(
            metric_name("router_goodput_requests"),
            "Finished requests that met every SLO given by --goodput (TTFT, TPOT, E2E, the "
            "longest gap between deltas); its rate is the goodput", registry=r),
        prefix_prediction_error=Histogram(
            metric_name("router_prefix_prediction_error_tokens"),
            "|cached prompt tokens the prefix index predicted for the instance that computed "
            "the prompt - those it reported using|, by instance (router/prefix_predictions.py)",
            ["instance"], buckets=PREFIX_ERROR_BUCKETS_TOKENS, registry=r),
        prefix_predictions=Counter(
            metric_name("router_prefix_predictions"),
            "Prefix-cache predictions checked against the engine's report, by instance and "
            "outcome (exact; over: the index claimed more than was used; under: less)",
            ["instance", "outcome"], registry=r),
        prefix_republish_asks=Counter(
            metric_name("router_prefix_republish_asks"),
            "Instances asked to re-publish their prefix-index slice because it drifted, by "
            "instance and outcome (sent, pending: an ask was already waiting, failed: Redis)",
            ["instance", "outcome"], registry=r),
        peer_prefix_offers=Counter(metric_name("router_peer_prefix"),
                                   "Cluster-wide prefix caching: requests whose prompt a peer "
                                   "held more of than the instance computing it, by what "
                                   "happened (pulled, reused: the target held them already, "
                                   "fallback, declined by the cost model, lender_empty, "
                                   "lend_failed)", ["outcome"], registry=r),
        peer_prefix_tokens=Counter(metric_name("router_peer_prefix_tokens"),
                                   "Prompt tokens pulled from a peer instead of computed",
                                   registry=r),
    )


def router_metrics(registry: CollectorRegistry | None = None) -> RouterMetrics:
    return _once("router", registry, _build_router)


@dataclass(frozen=True)
class RouterState:
    running: int
    queued: int
    inflight_tokens: int
    instances: Iterable[tuple[str, bool]]  # (role, healthy) of every known instance
    index_up: bool | None  # None: no Redis configured


class RouterCollector:
    """Scrape-time gauges of one router."""

    def __init__(self, state: Callable[[], RouterState]) -> None:
        self._state = state

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self._state()
        for name, doc, value in (
            ("router_requests_running", "Admitted requests being served", s.running),
            ("router_requests_queued", "Requests waiting for admission", s.queued),
            ("router_inflight_tokens", "Prompt + max output tokens of admitted requests",
             s.inflight_tokens),
        ):
            yield GaugeMetricFamily(metric_name(name), doc, value=value)
        counts: dict[tuple[str, str], int] = {}
        for role, healthy in s.instances:
            key = (role, "healthy" if healthy else "unhealthy")
            counts[key] = counts.get(key, 0) + 1
        family = GaugeMetricFamily(metric_name("router_instances"),
                                   "Known engine instances, by role and health",
                                   labels=["role", "state"])
        for (role, state), count in sorted(counts.items()):
            family.add_metric([role, state], count)
        yield family
        if s.index_up is not None:
            yield GaugeMetricFamily(
                metric_name("index_up"), "1 while the Redis prefix index is reachable, else 0",
                value=1.0 if s.index_up else 0.0)


# -- exposition ------------------------------------------------------------------------------------
@dataclass
class MetricsEndpoint:
    """A running /metrics HTTP server (its own daemon thread)."""

    host: str
    port: int
    _server: Any
    https: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.https else 'http'}://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_metrics_server(
    host: str, port: int, registry: CollectorRegistry | None = None, *,
    certfile: str | None = None, keyfile: str | None = None, names: str | None = None,
) -> MetricsEndpoint:
    """Serve `registry` (default: the process registry) on host:port; port 0 picks a free one.

    With `certfile`/`keyfile` (the service's --tls-cert/--tls-key) it serves HTTPS, so a TLS
    mesh has no plaintext port; scrapers need the CA, not a client certificate. `names`
    ("pdmesh" or "vllm"; None: env PDMESH_METRICS_NAMES) adds vLLM's names (metrics_vllm.py).
    Raises OSError naming the address when it cannot bind, ValueError for unknown `names`.
    """
    served = named_registry(registry or process_registry(), metrics_names(names))
    try:
        server, _thread = start_http_server(port, addr=host, registry=served, certfile=certfile,
                                            keyfile=keyfile)
    except OSError as exc:
        raise OSError(f"cannot serve /metrics on {host}:{port} ({exc.strerror or exc}); "
                      "choose another --metrics-port (0 = any free port, -1 = off)") from exc
    endpoint = MetricsEndpoint(host, server.server_port, server, https=bool(certfile))
    logger.info("metrics url=%s", endpoint.url)
    return endpoint
