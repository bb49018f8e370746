"""The engine service's watch over its core: NOT_SERVING while the core hangs with work in
flight, SERVING again as soon as it answers.

A core process that is stopped (SIGSTOP), or wedged in a device call, neither dies nor answers:
without this its service would go on passing health checks and load polls, and routers would
keep sending it requests that wait for as long as the hang lasts. The service sees every reply
the core sends; while work waits on the core (`CoreLiveness.busy`) and the core has been silent
for a moment, it sends a probe, which a live core answers between two steps. A core that has
owed an answer for longer than the stall bound (`engine/frontend/stall.py`: a multiple of its
longest
expected step, clamped to `--stall-timeout-min-s` .. `--stall-timeout-s`) is *stalled*: health
turns NOT_SERVING and GetLoad says `core_stalled`, so routers stop routing here and move the
calls waiting on it. The verdict holds, and probes go on, until the core answers again — even
once every request has left — so a hung instance does not come back to routing before it can
serve. Only silence the watchdog was awake to see counts: when the service itself was stopped
or starved (ticks late), its core is not blamed for the time the service did not look.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from pdmesh.engine.frontend.async_engine import AsyncEngine
from pdmesh.engine.frontend.stall import StallBound

logger = logging.getLogger(__name__)

PROBE_AFTER_S = 0.25
"""Core silence, with work in flight, after which the watchdog asks it for a sign of life."""
TICK_S = 0.1
MAX_TICK_S = 1.0
"""A longer gap between two checks counts as this much: the service itself was not running."""

OnChange = Callable[[bool], Awaitable[None]]
"""Told `serving` when the verdict changes."""


class CoreWatchdog:
    """Judges whether the engine core is stalled; `run` keeps judging and reports changes."""

    def __init__(self, engine: AsyncEngine, bound: StallBound, budget_tokens: int) -> None:
        self.engine = engine
        self.bound = bound
        self.budget_tokens = budget_tokens  # --max-num-batched-tokens: the longest step's size
        self.stalled = False
        self._stalled_at = 0.0
        self._checked_at = time.monotonic()
        self._seen_answer = engine.liveness.answered_at
        self._awake_silence = 0.0  # core silence seen while this watchdog ran

    def max_step_s(self) -> float:
        """The longest step the core may legitimately take now; 0 before its first step. While
        a slow one-off command is out (`CoreLiveness.setting_up`), the bound's upper clamp."""
        if self.engine.liveness.setting_up:
            return self.bound.max_s
        step_tokens = self.engine.step_tokens_bound(self.budget_tokens)
        return self.engine.liveness.step_times.longest_step_s(step_tokens)

    def bound_s(self) -> float:
        return self.bound.seconds(self.max_step_s())

    def silent_s(self) -> float:
        """How long the core has owed an answer (while stalled: since its last one), counting
        only time this watchdog was awake to see."""
        if self.stalled:
            return time.monotonic() - self.engine.liveness.answered_at
        return min(self.engine.liveness.silent_s(), self._awake_silence)

    def _watch_silence(self) -> None:
        now = time.monotonic()
        gap, self._checked_at = min(now - self._checked_at, MAX_TICK_S), now
        answered = self.engine.liveness.answered_at != self._seen_answer
        self._seen_answer = self.engine.liveness.answered_at
        if answered or not self.engine.liveness.busy:
            self._awake_silence = 0.0
        else:
            self._awake_silence += gap

    def check(self) -> bool | None:
        """Probe a silent core and judge it; the new verdict (serving?) when it changed."""
        engine = self.engine
        self._watch_silence()
        silent = self.silent_s()
        if silent >= PROBE_AFTER_S or (
                self.stalled and time.monotonic() - engine.liveness.answered_at >= PROBE_AFTER_S):
            engine.probe()
        if self.stalled:
            if engine.liveness.answered_at > self._stalled_at:
                self.stalled = False
                logger.warning("engine core answers again after %.1fs; serving",
                               time.monotonic() - self._stalled_at)
                return True
            return None
        bound = self.bound_s()
        engine.liveness.step_times.credible_s = bound  # a step longer than this is a hang
        if silent >= bound:
            self.stalled, self._stalled_at = True, time.monotonic()
            logger.error("engine core stalled: no answer for %.1fs with work in flight (bound "
                         "%.1fs, longest expected step %.2fs); NOT_SERVING", silent, bound,
                         self.max_step_s())
            return False
        return None

    async def run(self, on_change: OnChange) -> None:
        """Until cancelled (the process drains): judge every tick, report each change."""
        while True:
            await asyncio.sleep(TICK_S)
            serving = self.check()
            if serving is not None:
                await on_change(serving)
