"""The router checks its prefix-cache predictions against what the engines report.

Routing trusts the Redis prefix index: the leading blocks it says an instance holds are the
prompt tokens that instance will not compute. When a request finishes, the instance that
computed its prompt (the prefill instance, or the decode instance prefilling locally) reports
the prompt tokens it took from its cache (`cached_prompt_tokens`); this module compares that
with what the index predicted for the same instance at planning, per instance:

- error = predicted - reported, in tokens: positive is an over-prediction (the index credits
  blocks the engine no longer has: a lost removal, a cache reset the index missed), negative
  an under-prediction (the engine holds blocks the index lost: deleted or expired keys, a lost
  batch). Both mislead routing.
- metrics per instance: `pdmesh:router_prefix_prediction_error_tokens` (|error|) and
  `pdmesh:router_prefix_predictions_total{outcome="exact"|"over"|"under"}`;
- an instance whose predictions keep missing (`DriftRule`) is asked to re-publish its slice of
  the index: a key its presence loop reads on its next heartbeat, answered with a full
  snapshot (engine_svc/presence.py); asks are rate-limited per instance and counted
  (`pdmesh:router_prefix_republish_asks_total`), and the instance's record starts afresh.

The prediction is what the index said, capped as the engine caps a hit: whole blocks, and
never the prompt's last token (engine/scheduling/kv_cache_manager.py `find_cached_prefix`).
A request is left out when there is nothing to compare: the index was not consulted or did
not answer, the run moved (re-route, migration, a KV-load fallback), or the engine could not
have used its cache (prompt logprobs need every position computed).

Some misses are expected without any drift: blocks of a request still running are cached but
not yet published (under), a block evicted between lookup and scheduling (over). The rule
therefore asks only for misses of several blocks that persist across many requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry import trace
from prometheus_client.metrics import MetricWrapperBase

from pdmesh.kvstore.prefix_index import PrefixIndex
from pdmesh.kvstore.redis_conn import IndexUnavailable
from pdmesh.metrics import RouterMetrics
from pdmesh.router.request import Plan, PreparedRequest
from pdmesh.v1 import engine_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DriftRule:
    """When an instance's index slice counts as drifted, and how often it may be asked.

    Defaults: a miss is an error of >= 2 blocks (one block is within the publish delay of a
    request that shares the prefix and is still running); drift is >= 8 misses among an
    instance's last 16 checked requests (a burst of concurrent shared-prefix requests misses
    only while their blocks are unpublished, ~50 ms); one ask per instance a minute at most
    (a snapshot of a large cache is one big Redis script). An ask waits 30 s in Redis for the
    instance's heartbeat (every ttl/3, ~3.3 s) before it lapses.
    """

    min_blocks: int = 2
    misses: int = 8
    window: int = 16
    ask_interval_s: float = 60.0
    ask_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        if self.min_blocks < 1 or not 1 <= self.misses <= self.window:
            raise ValueError(f"need min_blocks >= 1 and 1 <= misses <= window: {self}")


@dataclass(frozen=True)
class Observation:
    """One request's prediction and report, for the instance that computed its prompt."""

    instance_id: str
    predicted_tokens: int
    reported_tokens: int
    block_size: int

    @property
    def error_tokens(self) -> int:
        """Signed: > 0 over-predicted, < 0 under-predicted."""
        return self.predicted_tokens - self.reported_tokens

    @property
    def outcome(self) -> str:
        error = self.error_tokens
        return "exact" if error == 0 else "over" if error > 0 else "under"


@dataclass
class InstanceRecord:
    """An instance's running record since it was last asked to re-publish."""

    window: int
    checked: int = 0
    exact: int = 0
    over: int = 0
    under: int = 0
    error_sum_tokens: int = 0  # signed
    recent: deque[int] = field(default_factory=deque)  # signed errors, last `window`
    asked_at: float | None = None

    def add(self, obs: Observation) -> None:
        self.checked += 1
        setattr(self, obs.outcome, getattr(self, obs.outcome) + 1)
        self.error_sum_tokens += obs.error_tokens
        self.recent.append(obs.error_tokens)
        while len(self.recent) > self.window:
            self.recent.popleft()

    @property
    def mean_error_tokens(self) -> float:
        return self.error_sum_tokens / self.checked if self.checked else 0.0

    def misses(self, min_error_tokens: int) -> int:
        return sum(1 for e in self.recent if abs(e) >= min_error_tokens)

    def restart(self, now: float) -> None:
        """After an ask: the counts start afresh, the ask time stays for the rate limit."""
        self.checked = self.exact = self.over = self.under = self.error_sum_tokens = 0
        self.recent.clear()
        self.asked_at = now


def predicted_tokens(plan: Plan, instance_id: str) -> int:
    """The cached prompt tokens the index promised `instance_id` at planning, capped as the
    engine caps its hit: whole blocks, leaving the prompt's last token to compute."""
    route = plan.route
    usable_blocks = max(0, route.num_prompt_tokens - 1) // route.block_size
    return min(plan.lookup.cached.get(instance_id, 0), usable_blocks) * route.block_size


def observe(req: PreparedRequest, plan: Plan, prefill: engine_pb2.PrefillResponse | None,
            result: engine_pb2.DecodeResult | None, *, moved: bool) -> Observation | None:
    """The comparison one finished request allows, or None (module docstring)."""
    if moved or not plan.lookup.consulted or not plan.lookup.ok:
        return None
    if req.sampling.HasField("prompt_logprobs"):
        return None
    if plan.prefill is not None:  # the prefill instance's own report, whatever decode did
        if prefill is None:
            return None
        instance, reporter = plan.prefill, prefill.instance_id
        reported = prefill.cached_prompt_tokens
    else:  # a local prefill; after a KV-load fallback the prompt was recomputed: no report
        if result is None or result.kv_load_fallback:
            return None
        instance, reporter = plan.decode, result.instance_id
        reported = result.usage.cached_prompt_tokens
    if not instance.instance_id or (reporter and reporter != instance.instance_id):
        return None  # not the instance planned (not expected unmoved): nothing to compare
    return Observation(instance.instance_id, predicted_tokens(plan, instance.instance_id),
                       reported, plan.route.block_size)


class PrefixPredictions:
    """Per-instance records of the index's predictions, their metrics, and the asks.

    `check` is the one call a request's run makes when it finishes; `record` is the rule
    alone (no I/O): True when the instance is due an ask."""

    MAX_INSTANCES = 256
    """Records (and metric series) kept; instance ids are per process start, so restarts
    would otherwise grow them without bound. The least recently checked goes first."""

    def __init__(self, metrics: RouterMetrics, index: PrefixIndex | None,
                 rule: DriftRule | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.index = index
        self.rule = rule or DriftRule()
        self.clock = clock
        self.records: OrderedDict[str, InstanceRecord] = OrderedDict()
        self._asks: set[asyncio.Task[None]] = set()

    def check(self, req: PreparedRequest, plan: Plan,
              prefill: engine_pb2.PrefillResponse | None,
              result: engine_pb2.DecodeResult | None, *, moved: bool) -> Observation | None:
        """Record a finished request's prediction (if it allows one) and, when its instance
        drifted, ask that instance to re-publish (in the background: never delays the
        request). Returns the observation (also on the request's span), or None."""
        obs = observe(req, plan, prefill, result, moved=moved)
        if obs is None:
            return None
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({
                "pdmesh.prefix_prediction.instance_id": obs.instance_id,
                "pdmesh.prefix_prediction.predicted_tokens": obs.predicted_tokens,
                "pdmesh.prefix_prediction.reported_tokens": obs.reported_tokens,
                "pdmesh.prefix_prediction.outcome": obs.outcome,
            })
        if self.record(obs) and self.index is not None:
            task = asyncio.get_running_loop().create_task(self.ask(obs.instance_id))
            self._asks.add(task)
            task.add_done_callback(self._asks.discard)
        return obs

    def record(self, obs: Observation) -> bool:
        """Count `obs`; True when its instance drifted past the rule and may be asked now
        (its record then starts afresh, and the next ask waits `ask_interval_s`)."""
        self.metrics.prefix_predictions.labels(obs.instance_id, obs.outcome).inc()
        self.metrics.prefix_prediction_error.labels(obs.instance_id).observe(
            abs(obs.error_tokens))
        record = self._record(obs.instance_id)
        record.add(obs)
        rule = self.rule
        if record.misses(rule.min_blocks * obs.block_size) < rule.misses:
            return False
        now = self.clock()
        if record.asked_at is not None and now - record.asked_at < rule.ask_interval_s:
            return False
        logger.info("prefix index drifted for instance_id=%s: %d of the last %d predictions "
                    "off by >= %d blocks (mean error %+.0f tokens); asking it to re-publish",
                    obs.instance_id, record.misses(rule.min_blocks * obs.block_size),
                    len(record.recent), rule.min_blocks, record.mean_error_tokens)
        record.restart(now)
        return True

    async def ask(self, instance_id: str) -> None:
        """Set the instance's re-publish ask in Redis (failures are counted, not raised)."""
        assert self.index is not None
        try:
            created = await self.index.ask_republish(instance_id, self.rule.ask_ttl_s)
        except IndexUnavailable as exc:
            logger.info("could not ask %s to re-publish: %s", instance_id, exc)
            outcome = "failed"
        else:
            outcome = "sent" if created else "pending"
        self.metrics.prefix_republish_asks.labels(instance_id, outcome).inc()

    async def drain(self) -> None:
        """Wait for asks still in flight (shutdown, tests)."""
        if self._asks:
            await asyncio.gather(*self._asks, return_exceptions=True)

    def _record(self, instance_id: str) -> InstanceRecord:
        record = self.records.get(instance_id)
        if record is None:
            record = self.records[instance_id] = InstanceRecord(self.rule.window)
            while len(self.records) > self.MAX_INSTANCES:
                self._forget(next(iter(self.records)))
        self.records.move_to_end(instance_id)
        return record

    def _forget(self, instance_id: str) -> None:
        """Drop an instance's record and its metric series."""
        del self.records[instance_id]
        m = self.metrics
        for outcome in ("exact", "over", "under"):
            _remove(m.prefix_predictions, instance_id, outcome)
        _remove(m.prefix_prediction_error, instance_id)
        for outcome in ("sent", "pending", "failed"):
            _remove(m.prefix_republish_asks, instance_id, outcome)


def _remove(metric: MetricWrapperBase, *labels: str) -> None:
    """Remove one labelled series if it exists (prometheus_client raises KeyError if not)."""
    with contextlib.suppress(KeyError):
        metric.remove(*labels)
