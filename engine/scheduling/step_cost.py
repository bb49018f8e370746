"""What a step costs, learned online from the steps the engine runs.

A step's time is close to linear in a few counts of its work (Sarathi-Serve, SGLang's dynamic
chunking): a fixed overhead per step (launches, Python), a cost per row (each sequence's logits
over the vocabulary, sampling and bookkeeping; on GPU with CUDA graphs the decode part is a
bucket), a cost per token computed (the linear layers, which dominate on CPU and for long
prefills on GPU) and the attention work, which grows with each new token's context: a row of
`x` new tokens after `L` computed ones attends over `x·L + x(x+1)/2` (query, key) pairs. So

    t = c + b·rows + a·(tokens + k·pairs)

where `k`, attention's cost per pair in tokens, is the ratio of their FLOPs from the model's
shape (`attention_weight`): left free, it cannot be told from the cost per token in the steps
a server sees (chunks of similar size at similar contexts) and a fit would hand the whole cost
to whichever it likes, which then extrapolates badly to a longer chunk.

`StepCostModel` fits (c, b, a) by least squares over the recent steps, on relative error (a
decode step's 10% error matters as much as a prefill's), refitting every few steps,
coefficients kept non-negative (a negative cost would let the budget promise time it does not
have). It predicts nothing until it has seen enough steps, some of them with prefill tokens,
and says so (`ready`). Meanwhile a step budget plans with a provisional cost from the largest
prefill step seen (`budget_cost`, `provisional_cost`); before any, the scheduler keeps its fixed
token budget.

The fitted model is also exported (`StepCostModel.prefill_tokens_per_s`, in each load report):
the prompt tokens per second of back-to-back full chunks (`max_num_batched_tokens` tokens in one
row at context 0), from which the router predicts how long the prompts queued ahead of a request
take to prefill (router/queue_delay.py). One number suffices there: the router predicts a
backlog of many prompts, which the engine computes in full chunks, so the per-step overhead is
spread over a chunk as this rate spreads it. The coefficients themselves would add only the
time of a lone short prompt, which the router never refuses, and would need the chunk size
beside them.

Costs are the steps' host wall time (`EngineCore.step`), which on a GPU with async scheduling
is the device's step time in the steady state. One model per engine core: it is the engine's
own hardware, model and batch shape that it learns, which is why nothing is configured.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

WINDOW_STEPS = 512
"""Steps the fit remembers: long enough to hold prefill and decode steps of several requests,
short enough to follow a machine whose speed changes (another engine starting beside it)."""
REFIT_EVERY = 8
"""Steps between two fits (a 4-column least squares: ~50 us)."""
MIN_STEPS = 16
"""Steps seen before the model predicts anything."""
MIN_PREFILL_STEPS = 4
"""Of those, steps with more tokens than rows (a prefill chunk), without which the cost per
token cannot be told from the cost per row."""
MIXED_SMOOTHING = 0.1
"""Weight of the newest mixed step in `StepCostModel.mixed_ratio` (an EMA over ~10 steps)."""
MIXED_RATIO_BOUNDS = (0.5, 4.0)


@dataclass(frozen=True)
class StepWork:
    """The counts a step's cost depends on."""

    tokens: int = 0
    rows: int = 0
    pairs: float = 0.0  # attention (query, key) pairs

    def plus_row(self, context: int, new_tokens: int) -> StepWork:
        """This work with one more row of `new_tokens` tokens after `context` computed ones."""
        return StepWork(self.tokens + new_tokens, self.rows + 1,
                        self.pairs + attention_pairs(context, new_tokens))

    @property
    def has_prefill(self) -> bool:
        return self.tokens > self.rows


def attention_pairs(context: int, new_tokens: int) -> float:
    """(query, key) pairs a row of `new_tokens` tokens after `context` ones attends over."""
    return new_tokens * context + new_tokens * (new_tokens + 1) / 2


def attention_weight(num_heads: int, num_kv_heads: int, head_dim: int, hidden: int,
                     intermediate: int) -> float:
    """Attention's FLOPs per (query, key) pair over the linear layers' FLOPs per token (a
    decoder layer with q/k/v/o projections and a gated MLP): 2·heads·head_dim over the layer's
    weights, per layer on both sides (SmolLM2-135M: 3.3e-4: a token at 3,000 of context
    costs twice one at 0)."""
    attn_width = num_heads * head_dim
    weights = (2 * hidden * attn_width + 2 * hidden * num_kv_heads * head_dim
               + 3 * hidden * intermediate)
    return 2 * attn_width / weights


def work_of(rows: list[tuple[int, int]]) -> StepWork:
    """A step's work from its rows' (context, new tokens)."""
    work = StepWork()
    for context, new_tokens in rows:
        work = work.plus_row(context, new_tokens)
    return work


@dataclass(frozen=True)
class StepCost:
    """Fitted coefficients: seconds per step, per token, per row, per attention pair."""

    base_s: float
    per_token_s: float
    per_row_s: float
    per_pair_s: float

    def seconds(self, work: StepWork) -> float:
        return (self.base_s + self.per_token_s * work.tokens + self.per_row_s * work.rows
                + self.per_pair_s * work.pairs)

    def tokens_within(self, seconds: float, context: int) -> int:
        """The most new tokens one more row after `context` computed ones may take for its
        cost to stay within `seconds` (0 when not even its row fits): the positive root of
        g/2·x² + (a + g·L + g/2)·x + b = seconds."""
        left = seconds - self.per_row_s
        if left <= 0:
            return 0
        quad = self.per_pair_s / 2
        lin = self.per_token_s + self.per_pair_s * (context + 0.5)
        if quad <= 0:
            return int(left / lin) if lin > 0 else 1 << 30
        return int((-lin + (lin * lin + 4 * quad * left) ** 0.5) / (2 * quad))

    def prefill_tokens_per_s(self, chunk_tokens: int) -> float:
        """Prompt tokens per second of prefill steps of one `chunk_tokens`-token row at
        context 0 (0 when the cost says nothing, e.g. every coefficient fitted to 0)."""
        if chunk_tokens <= 0:
            return 0.0
        seconds = self.seconds(work_of([(0, chunk_tokens)]))
        return chunk_tokens / seconds if seconds > 0 else 0.0


def provisional_cost(steps: Iterable[tuple[StepWork, float]],
                     pair_weight: float = 0.0) -> StepCost | None:
    """A cost from too few steps to fit: each token (attention pairs weighed in as the fit
    weighs them) at the largest prefill step's time per token, its base and rows spread over
    its tokens: on the safe side, chunks come out smaller; each decode row at the decode-only
    steps' median time per row (a token's cost when none was seen). None before a prefill
    step."""
    prefill = [(work, s) for work, s in steps if work.has_prefill]
    if not prefill:
        return None
    work, seconds = max(prefill, key=lambda step: step[0].tokens)
    per_token = seconds / (work.tokens + pair_weight * work.pairs)
    per_decode_row = [s / work.rows for work, s in steps if not work.has_prefill]
    per_row = float(np.median(per_decode_row)) if per_decode_row else per_token
    return StepCost(0.0, per_token, max(0.0, per_row - per_token), pair_weight * per_token)


def _fit(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error for a handful of columns: plain least
    squares, then drop the columns that came out negative and refit without them (an active
    set, at most one pass per column). Each row is divided by its step's time (relative
    error) and columns are scaled to unit maximum (their sizes do not decide the fit)."""
    rows = features / seconds[:, None]
    scale = np.maximum(np.abs(rows).max(axis=0), 1e-12)
    scaled = rows / scale
    ones = np.ones(len(seconds))
    active = list(range(features.shape[1]))
    coef = np.zeros(features.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(scaled[:, active], ones, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active = [col for col, value in zip(active, sol, strict=True) if value > 0]
    return coef / scale


class StepCostModel:
    """The engine's step cost, refitted from its recent steps."""

    def __init__(self, pair_weight: float = 0.0) -> None:
        """`pair_weight`: attention's cost per pair in tokens (`attention_weight`)."""
        self.pair_weight = pair_weight
        self._steps: deque[tuple[StepWork, float]] = deque(maxlen=WINDOW_STEPS)
        self._since_fit = 0
        self.cost: StepCost | None = None
        self.mixed_ratio = 1.0
        """Actual over predicted time of recent *mixed* steps (decodes and a prefill chunk),
        the steps a budget plans: one linear fit over every step tends to under-predict them
        (a chunk after earlier chunks attends over a paged context, on a CPU a slower kernel
        than a fresh prompt's), and the budget divides its target by this."""

    @property
    def ready(self) -> bool:
        return self.cost is not None

    @property
    def budget_cost(self) -> StepCost | None:
        """The cost a step budget plans with: the fit once ready, before that a provisional
        cost from the few steps seen, as soon as one of them carried a prefill chunk. A fresh
        server's first burst otherwise runs unbounded: its first prompts' decodes wait beside
        full `max_num_batched_tokens` steps (~2.5 s on a 2-core CPU), and in a closed loop the
        next prefill steps come only when those streams finish, dozens of steps later.
        Not exported (`predict`, `prefill_tokens_per_s` wait for the fit)."""
        return (self.cost if self.cost is not None
                else provisional_cost(self._steps, self.pair_weight))

    def predict(self, work: StepWork) -> float | None:
        """Seconds the step should take; None while the model knows too little."""
        return None if self.cost is None else self.cost.seconds(work)

    def prefill_tokens_per_s(self, chunk_tokens: int) -> float:
        """The predicted prefill throughput in full chunks of `chunk_tokens` (the engine's
        `max_num_batched_tokens`); 0 while the model knows too little. See the module doc."""
        return 0.0 if self.cost is None else self.cost.prefill_tokens_per_s(chunk_tokens)

    def observe(self, work: StepWork, seconds: float) -> None:
        if work.rows <= 0 or seconds <= 0:
            return
        if self.cost is not None and work.has_prefill and work.rows > 1:
            ratio = seconds / max(self.cost.seconds(work), 1e-9)
            low, high = MIXED_RATIO_BOUNDS
            self.mixed_ratio += MIXED_SMOOTHING * (min(high, max(low, ratio)) - self.mixed_ratio)
        self._steps.append((work, seconds))
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY or (self.cost is None and self._enough()):
            self._refit()

    def _enough(self) -> bool:
        return (len(self._steps) >= MIN_STEPS
                and sum(work.has_prefill for work, _ in self._steps) >= MIN_PREFILL_STEPS)

    def _refit(self) -> None:
        self._since_fit = 0
        if not self._enough():
            return
        k = self.pair_weight
        features = np.array([(1.0, w.rows, w.tokens + k * w.pairs) for w, _ in self._steps])
        seconds = np.array([s for _, s in self._steps])
        base, per_row, per_token = (float(v) for v in _fit(features, seconds))
        self.cost = StepCost(base, per_token, per_row, k * per_token)


@dataclass
class PredictionStats:
    """Cumulative predicted and actual seconds of the steps the model predicted (metrics:
    how far off it is)."""

    steps: int = 0
    predicted_s: float = 0.0
    actual_s: float = 0.0

    def add(self, predicted_s: float, actual_s: float) -> None:
        self.steps += 1
        self.predicted_s += predicted_s
        self.actual_s += actual_s
