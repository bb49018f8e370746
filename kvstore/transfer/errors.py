"""Errors of the KV-transfer layer.

Every failure a waiting side can see is a `KVTransferError` subclass, so callers can catch one
type and fall back to recompute; the subclass says why, for logs and metrics.
"""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdmesh.kvstore.transfer.state import TransferState


class KVTransferError(Exception):
    """Base class: the KV of a request could not be moved."""

    def __init__(self, message: str, *, transfer_id: str = "", request_id: str = "") -> None:
        super().__init__(message)
        self.transfer_id = transfer_id
        self.request_id = request_id
        # The sender-side state that caused the error, when one did (crosses gRPC as metadata).
        self.state: TransferState | None = None


class KVWireError(KVTransferError):
    """Bytes on the data plane failed validation (magic, size, layout, ids, dtype)."""


class KVChecksumError(KVWireError):
    """The payload's checksum does not match the one published by the sender."""


class KVHandleError(KVTransferError, ValueError):
    """A handle or layout is malformed (bad field, unsupported dtype, inconsistent shape)."""


class KVTransferTimeout(KVTransferError, TimeoutError):
    """The caller's deadline passed before the transfer finished."""


class KVTransferExpired(KVTransferError):
    """The sender's lease ran out; the KV is gone."""


class KVTransferCancelled(KVTransferError):
    """Either side cancelled the transfer."""


class KVTransferNotFound(KVTransferError):
    """The sender does not know the transfer (never published, or a restarted sender)."""


class KVTransferRejected(KVTransferError):
    """The sender refused the call (request id mismatch, wrong state, unsupported backend)."""


class KVTransferDenied(KVTransferRejected):
    """The sender will not serve this caller: no valid transfer capability (the router bound
    the transfer to another instance), or shm without proof of sharing the host."""


class KVTransferFailed(KVTransferError):
    """The transfer was marked failed (e.g. the receiver reported corrupt bytes)."""


class KVSenderUnavailable(KVTransferError):
    """The sender cannot be reached or vanished mid-transfer."""


class KVBackendUnavailable(KVTransferError):
    """No data-plane backend usable by both sides, or its library is not installed."""


_OUTCOMES: tuple[tuple[type[BaseException], str], ...] = (
    (KVTransferTimeout, "timeout"),
    (KVTransferExpired, "expired"),
    (KVTransferCancelled, "cancelled"),
    (KVChecksumError, "checksum"),
    (KVBackendUnavailable, "backend_unavailable"),
    (asyncio.CancelledError, "cancelled"),
)


def failure_outcome(exc: BaseException) -> str:
    """A low-cardinality label for why a transfer failed (metrics, fallbacks)."""
    for error_type, outcome in _OUTCOMES:
        if isinstance(exc, error_type):
            return outcome
    if isinstance(exc, KVTransferError):
        name = type(exc).__name__.removeprefix("KV")  # e.g. SenderUnavailable
        return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()  # -> sender_unavailable
    return "error"
