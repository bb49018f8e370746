"""Absolute deadlines on the monotonic clock.

Every wait in the transfer layer takes its timeout from one `Deadline`, so nested steps
(control RPC, data plane, ack) share one budget instead of each adding its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadline:
    """A point on `time.monotonic()` after which the work is abandoned."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    @classmethod
    def coerce(cls, value: Deadline | float) -> Deadline:
        """Accept a `Deadline` or a relative timeout in seconds."""
        if isinstance(value, Deadline):
            return value
        return cls.after(float(value))

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at
