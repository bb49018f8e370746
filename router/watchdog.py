"""The router's progress watchdog: a call waiting on a hung instance moves instead of waiting
out the hang.

A stopped or wedged instance (its engine core, or its whole process) fails nothing: its calls
just stop making progress until the request's deadline. A `CallWatch` guards one Prefill call
or Decode stream and cancels it once it has *fired*, and the request's run moves the request
the way it moves one whose instance died (router/recovery.py: another prefill instance or
local prefill; decode migration, token-exact).

The rule: the call fires when, for the instance's stall bound B (`engine/frontend/stall.py`: a
multiple
of the longest step the instance says it expects, clamped to `--stall-timeout-min-s` ..
`--stall-timeout-s`),

1. the call itself has received nothing for B, and
2. the *instance* has shown no progress for B: no delta of any call on it, and no GetLoad
   answer saying its core answered within that time (`Instance.progress_at`). Before judging
   an instance whose polls answer, the watch asks it once more
   (`InstancePool.confirm_progress`), so evidence that is merely old (a long poll interval)
   never condemns it; one whose last poll failed or timed out is judged as it is.

Progress of the instance, not of the stream, is what counts: a stream waiting in the queue
behind a long prefill, preempted, or waiting for its KV to arrive from a prefill instance is
silent while its instance steps (or idles, owing nothing), and it stays where it is. An engine
mid-step answers nothing either, which is why B scales with the longest step the instance
expects now (as long as the prompts waiting in it can make one) rather than its mean step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from types import TracebackType

from pdmesh.router.instance import Instance
from pdmesh.router.instances import InstancePool

logger = logging.getLogger(__name__)

MIN_SLEEP_S = 0.05


class CallWatch:
    """Guards one call on one instance (`async with`); `progressed()` on each message."""

    def __init__(self, pool: InstancePool, instance: Instance, cancel: Callable[[], object],
                 what: str) -> None:
        self.pool = pool
        self.instance = instance
        self.what = what  # "prefill" or "decode", for logs
        self._cancel = cancel
        self.quiet_since = time.monotonic()
        self.fired_after_s: float | None = None  # how long the call was quiet when it fired
        self._task: asyncio.Task[None] | None = None

    @property
    def fired(self) -> bool:
        return self.fired_after_s is not None

    def progressed(self) -> None:
        """The call received something: it, and so its instance, made progress."""
        now = time.monotonic()
        self.quiet_since = now
        self.instance.note_progress(now)

    def _due(self) -> float:
        """When the call may be judged: B after the later of its own and its instance's last
        progress."""
        bound = self.instance.stall_bound_s(self.pool.settings.stall)
        return max(self.quiet_since, self.instance.progress_at) + bound

    async def _watch(self) -> None:
        while True:
            wait = self._due() - time.monotonic()
            if wait > 0:
                await asyncio.sleep(max(wait, MIN_SLEEP_S))
                continue
            if not self.instance.failures:  # its polls answer: ask once more before accusing
                await self.pool.confirm_progress(self.instance)
                if self._due() > time.monotonic():
                    continue
            self.fired_after_s = time.monotonic() - self.quiet_since
            logger.warning("%s call to %s made no progress for %.1fs, nor did its instance "
                           "(stall bound %.1fs): moving it", self.what, self.instance.address,
                           self.fired_after_s,
                           self.instance.stall_bound_s(self.pool.settings.stall))
            self._cancel()
            return

    async def __aenter__(self) -> CallWatch:
        self._task = asyncio.get_running_loop().create_task(
            self._watch(), name=f"watch {self.what} {self.instance.address}")
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._task is not None:  # not awaited: that could swallow our own cancellation
            self._task.cancel()
