"""Admission by predicted wait: refuse a request whose first token would come too late.

Queueing without limit turns overload into timeouts for everyone (64 streams of 2k-token
prompts on 1P+2D: TTFT p50 99 s, 109 of 126 clients timed out, not one told to back off).
Instead, before admitting a request the router predicts its time to first token and, past
`--max-queue-delay-s`, answers RESOURCE_EXHAUSTED with a retry hint (the gateway's 429 with
`Retry-After`), so the requests it admits keep their latency.

The prediction:

    wait = (backlog + prompt) / rate

- `backlog`: prompt tokens this router admitted whose first token has not come back yet (the
  prefill work ahead of the request; the router's own count, exact and current, where the
  engines' polled queues lag and do not say how long their prompts are);
- `rate`: prompt tokens per second the instances that would prefill it compute: the sum, over
  the healthy prefill instances (decode-capable ones when there is none: they prefill
  locally), of each instance's rate:
  - its *model rate* when it reports one (`EngineLoad.model_prefill_tokens_per_s`): what the
    engine's learned step-cost model (engine/scheduling/step_cost.py) predicts for back-to-back
    full chunks, `C / (c + b + a·(C + k·C(C+1)/2))` for a chunk of `C` =
    `max_num_batched_tokens` tokens at context 0 (c, b, a, k: the model's cost per step, per
    row, per token and attention's weight per pair). It is a prediction of the prefill speed
    itself, fitted over hundreds of steps, and there from the engine's first few prefill
    steps, where a measured rate needs a poll interval spent mostly prefilling;
  - otherwise (an older engine, or its model not fitted yet) its best measured rate: the
    largest scheduled tokens per second of step time between two of its load polls within
    `RATE_WINDOW_S`. The best interval is the one spent on prefill chunks, which is what the
    backlog needs; an instance only decoding shows a lower rate, but then there is no backlog
    to predict for.

Before any instance reports a model rate or has measured one, nothing is refused. Both rates
are of the engine's fastest prefill (full chunks at no context; the best interval), so the
prediction errs short for prompts far longer than a chunk (their later chunks attend over more
context) and on a colocated instance whose ITL target cuts chunks beside running streams
(engine/scheduling/step_budget.py); prefix-cache hits are not subtracted (the router does not
know them at admission), so it errs long for prompts that are mostly cached.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdmesh.router.admission import OverCapacity

RATE_WINDOW_S = 60.0
"""How far back an instance's best rate is looked for: long enough to span a lull between
bursts, short enough to follow a slower instance replacing a faster one."""

MIN_INTERVAL_TOKENS = 64
"""Poll intervals that computed fewer tokens say little about prefill speed."""

MAX_RETRY_AFTER_S = 60.0


@dataclass
class _Rates:
    last: tuple[int, float] = (0, 0.0)  # (scheduled_tokens, step_seconds) at the last poll seen
    samples: deque[tuple[float, float]] = field(default_factory=deque)  # (at, tokens/s)

    def observe(self, tokens: int, seconds: float, now: float) -> None:
        d_tokens, d_seconds = tokens - self.last[0], seconds - self.last[1]
        self.last = (tokens, seconds)
        if d_tokens >= MIN_INTERVAL_TOKENS and d_seconds > 0:
            self.samples.append((now, d_tokens / d_seconds))
        while self.samples and now - self.samples[0][0] > RATE_WINDOW_S:
            self.samples.popleft()

    def best(self) -> float:
        return max((rate for _, rate in self.samples), default=0.0)


@dataclass(frozen=True)
class Worker:
    """What the predictor reads of one instance (its polled counters)."""

    instance_id: str
    prefills: bool  # a prefill instance
    healthy: bool
    scheduled_tokens: int
    step_seconds: float
    model_rate: float = 0.0  # EngineLoad.model_prefill_tokens_per_s; 0: none reported


class QueueDelay:
    """One router's backlog and the instances' rates; one asyncio loop."""

    def __init__(self, max_delay_s: float) -> None:
        self.max_delay_s = max_delay_s  # 0: off
        self.backlog_tokens = 0
        self._rates: dict[str, _Rates] = {}

    def observe(self, workers: Iterable[Worker], now: float | None = None) -> None:
        """Fold in the instances' latest polled counters."""
        now = time.monotonic() if now is None else now
        for w in workers:
            self._rates.setdefault(w.instance_id, _Rates()).observe(
                w.scheduled_tokens, w.step_seconds, now)

    def rate(self, workers: Iterable[Worker]) -> float:
        """Prompt tokens per second the instances that would prefill compute together."""
        live = [w for w in workers if w.healthy]
        prefill = [w for w in live if w.prefills] or live
        return sum(self.instance_rate(w) for w in prefill)

    def instance_rate(self, worker: Worker) -> float:
        """One instance's prefill rate: its step-cost model's, else its best measured one (0
        when it has neither yet)."""
        if worker.model_rate > 0:
            return worker.model_rate
        measured = self._rates.get(worker.instance_id)
        return measured.best() if measured is not None else 0.0

    def predict(self, prompt_tokens: int, workers: Iterable[Worker]) -> float | None:
        """Seconds to this request's first token, or None before any instance has a rate."""
        rate = self.rate(workers)
        return (self.backlog_tokens + prompt_tokens) / rate if rate > 0 else None

    def admit(self, prompt_tokens: int, workers: Iterable[Worker]) -> None:
        """OverCapacity when the predicted wait passes the bound (and the router is busy: a
        request alone is never refused for its own length)."""
        if not self.max_delay_s or not self.backlog_tokens:
            return
        predicted = self.predict(prompt_tokens, workers)
        if predicted is None or predicted <= self.max_delay_s:
            return
        retry_s = min(MAX_RETRY_AFTER_S, max(1.0, predicted - self.max_delay_s))
        raise OverCapacity(
            f"overloaded: the first token would come in ~{predicted:.0f}s "
            f"({self.backlog_tokens} prompt tokens queued ahead), over --max-queue-delay-s="
            f"{self.max_delay_s:g}", retry_s, reason="predicted_delay")

    def started(self, prompt_tokens: int) -> None:
        self.backlog_tokens += prompt_tokens

    def first_token(self, prompt_tokens: int) -> None:
        """The request's prefill is done (or it ended without one): off the backlog."""
        self.backlog_tokens = max(0, self.backlog_tokens - prompt_tokens)
