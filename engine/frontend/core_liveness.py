"""What tells a busy engine core from a hung one, as its serving side sees it.

A core that lives answers every command, fire-and-forget ones with a Batch, between two
steps. So the serving side notes when it started to owe an answer (work arrived at an idle
core, or any command was sent) and when the core last answered; `silent_s` is how long it has
owed one without answering. `step_times` (engine/frontend/stall.py) says how long its steps take and
`step_tokens_bound` how large its next step can be, from the prompts not computed yet. The
service's watchdog (engine_svc/watchdog.py) reads them; `AsyncEngine` keeps them current.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pdmesh.engine.frontend.stall import StepTimes


class CoreLiveness:
    def __init__(self, waiting: Callable[[], int]) -> None:
        """`waiting`: how many requests and calls wait on the core right now."""
        self._waiting = waiting
        self.step_times = StepTimes()
        self.answered_at = time.monotonic()  # the core's last reply
        self._owed_since = self.answered_at  # since when it owes one (see silent_s)
        self._owing = False  # a command went to the core, which has not answered since
        self._probed = False  # a probe is out and the core has not answered since
        self.setting_up = False  # a one-off command that may hold the core for seconds is out
        self.unprefilled: dict[str, int] = {}  # prompt tokens of requests with no output yet

    @property
    def busy(self) -> bool:
        """The core owes an answer: requests or calls wait on it, or it has not answered a
        command yet (so a core that hangs keeps owing after its requests were aborted)."""
        return self._owing or self._waiting() > 0

    def silent_s(self) -> float:
        """Seconds the core has owed an answer without giving one: since its last reply or
        since work arrived at an idle core, whichever is later (an idle core: 0)."""
        return time.monotonic() - self._owed_since if self.busy else 0.0

    def owe(self) -> None:
        """Work is about to wait on the core: an idle one starts owing an answer now."""
        if not self.busy:
            self._owed_since = time.monotonic()
        self._owing = True

    def answered(self) -> None:
        self.answered_at = self._owed_since = time.monotonic()
        self._owing = self._probed = False

    def take_probe(self) -> bool:
        """Whether to send a probe now: not while one is out (the core has not answered)."""
        if self._probed:
            return False
        self._probed = True
        self.owe()
        return True

    def step_tokens_bound(self, budget_tokens: int, running: int) -> int:
        """The most tokens the core's next step can compute: the prompts not computed yet (as
        far as this side knows: none of their outputs came) plus a token per running request,
        within the step budget. A long step is only possible when a long prompt waits."""
        return min(budget_tokens, sum(self.unprefilled.values()) + running)
