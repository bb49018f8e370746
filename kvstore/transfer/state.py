"""Transfer states and release reasons.

A transfer moves PENDING -> TRANSFERRING -> DONE, or to one of the terminal failure states
from either live state. Terminal states never change again; that is what makes the
sender's release callback fire exactly once.
"""

from __future__ import annotations

import enum


class TransferState(enum.Enum):
    PENDING = 1
    TRANSFERRING = 2
    DONE = 3
    FAILED = 4
    EXPIRED = 5
    CANCELLED = 6

    @property
    def terminal(self) -> bool:
        return self not in (TransferState.PENDING, TransferState.TRANSFERRING)


class ReleaseReason(enum.StrEnum):
    """Why the sender let go of a request's KV (passed to its `on_release` callback)."""

    ACKED = "acked"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    SHUTDOWN = "shutdown"


TERMINAL_STATE_FOR: dict[ReleaseReason, TransferState] = {
    ReleaseReason.ACKED: TransferState.DONE,
    ReleaseReason.FAILED: TransferState.FAILED,
    ReleaseReason.EXPIRED: TransferState.EXPIRED,
    ReleaseReason.CANCELLED: TransferState.CANCELLED,
    ReleaseReason.SHUTDOWN: TransferState.CANCELLED,
}
