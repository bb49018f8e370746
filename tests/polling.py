"""Waiting for a condition in end-to-end tests: poll with a deadline, never sleep blindly."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], what: str, timeout_s: float = 60.0,
             interval_s: float = 0.05) -> T:
    """Poll `predicate` until it returns something truthy (returned); fail at the deadline,
    naming `what` and the last value seen."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last: {last!r}")
