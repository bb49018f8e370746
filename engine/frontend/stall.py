"""When an engine that has work counts as hung: a bound derived from its own step times.

A hung engine (a stopped process, a wedged device) looks exactly like a busy one from outside:
nothing comes out. What tells them apart is time measured against what the engine's steps
normally take. Two watchers use the same rule with their own knobs: the engine service, which
turns NOT_SERVING when its core stops answering (`engine_svc/watchdog.py`), and the router,
which moves calls off an instance that shows no progress (`router/watchdog.py`).

The step time that matters is the longest step the engine may legitimately take now, not the
mean: one full token-budget prefill chunk on a CPU takes seconds while decode steps take tens
of milliseconds, and an engine in such a step answers nothing. `StepTimes` bounds it from the
recent steps: the slowest one seen, or a step as large as the next one can be (the prompts
waiting to be computed, within `max_num_batched_tokens`; `AsyncEngine.step_tokens_bound`) at
the cheapest cost per token seen (a step costs about a fixed overhead plus a cost per token,
so the cheapest observed cost per token is an upper bound on the per-token part), whichever is
longer. So the bound stays a few decode steps long while the engine only decodes, and widens
while a long prompt waits, which is when a stream queued behind it may see a long pause.
A step longer than the stall bound in force when it ran (`StepTimes.credible_s`) is not taken
as a step: it is the hang itself (a core stopped mid-step finishes that step when it resumes),
and letting it widen the bound would make the next hang cost many times more.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from pdmesh.config import about

RECENT_STEPS = 256
"""Steps `StepTimes` remembers; an old long step stops widening the bound after this many."""


@dataclass(frozen=True)
class StallBound:
    """Patience with a silent engine: `step_multiple` times its longest expected step,
    clamped to [`min_s`, `max_s`]; `max_s` while its step time is unknown."""

    min_s: float = 3.0
    max_s: float = 30.0
    step_multiple: float = 4.0

    def __post_init__(self) -> None:
        if not 0 < self.min_s <= self.max_s:
            raise ValueError(f"stall bound: need 0 < min_s <= max_s, got {self.min_s}, "
                             f"{self.max_s}")
        if self.step_multiple <= 0:
            raise ValueError(f"stall bound: step_multiple must be > 0, got {self.step_multiple}")

    def seconds(self, max_step_s: float | None) -> float:
        """The bound for an engine whose longest expected step is `max_step_s` (None or 0:
        not known yet)."""
        if not max_step_s:
            return self.max_s
        return min(self.max_s, max(self.min_s, self.step_multiple * max_step_s))


@dataclass
class StallConfig:
    """The stall bound's knobs, declared once: the router's and the engine services' configs
    embed it (same flags, each its own value)."""

    stall_timeout_s: float = field(default=StallBound.max_s, metadata=about(
        "the longest an instance (router: a call waiting on it; engine service: its core with "
        "work in flight) may show no progress before it counts as hung: the router moves the "
        "call, the service reports NOT_SERVING (seconds; the stall bound's upper clamp)"))
    stall_timeout_min_s: float = field(default=StallBound.min_s, metadata=about(
        "the stall bound's lower clamp (seconds)"))
    stall_step_multiple: float = field(default=StallBound.step_multiple, metadata=about(
        "the stall bound in multiples of the engine's longest expected step (GetLoad's "
        "max_step_s), between the clamps"))

    def __post_init__(self) -> None:
        if not 0 < self.stall_timeout_min_s <= self.stall_timeout_s:
            raise ValueError("need 0 < --stall-timeout-min-s <= --stall-timeout-s, got "
                             f"{self.stall_timeout_min_s} and {self.stall_timeout_s}")
        if self.stall_step_multiple <= 0:
            raise ValueError(f"--stall-step-multiple must be > 0, got "
                             f"{self.stall_step_multiple}")

    def bound(self) -> StallBound:
        return StallBound(min_s=self.stall_timeout_min_s, max_s=self.stall_timeout_s,
                          step_multiple=self.stall_step_multiple)


class StepTimes:
    """An engine's recent steps, fed its cumulative counters (`EngineLoadSnapshot`)."""

    def __init__(self) -> None:
        self._steps: deque[tuple[float, float]] = deque(maxlen=RECENT_STEPS)  # (s, tokens)
        self._seen = (0, 0.0, 0)  # num_steps, step_seconds, scheduled_tokens
        self.credible_s = math.inf  # longer steps are hangs, not steps (the watchdog sets it)

    def observe(self, num_steps: int, step_seconds: float, scheduled_tokens: int) -> None:
        """Take the counters after some steps; several steps since the last call count as
        that many steps of their mean size."""
        steps, seconds, tokens = self._seen
        ran = num_steps - steps
        if ran <= 0:
            return
        self._seen = (num_steps, step_seconds, scheduled_tokens)
        per_step = (step_seconds - seconds) / ran
        if per_step <= self.credible_s:
            self._steps.append((per_step, (scheduled_tokens - tokens) / ran))

    def longest_step_s(self, step_tokens: int) -> float:
        """The longest step to expect when a step may compute up to `step_tokens` tokens; 0
        before any step."""
        if not self._steps:
            return 0.0
        slowest = max(seconds for seconds, _ in self._steps)
        per_token = min((seconds / tokens for seconds, tokens in self._steps if tokens > 0),
                        default=0.0)
        return max(slowest, per_token * step_tokens)
