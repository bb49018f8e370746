"""The sender's table of published KV and their leases.

This is where the KV-lifetime rules live (FIELD-NOTES: the most damaging bug class):

* a published KV is pinned until its transfer reaches a terminal state (acked, failed,
  expired, cancelled, shutdown) *and* no data-plane stream is still reading it;
* the release callback then fires exactly once, outside the lock;
* a terminal state never changes, and later calls get an error naming that state, so a
  receiver can never be handed KV whose lease already ran out.

Thread-safe: the gRPC control plane, data-plane threads and the engine all call in.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdmesh.kvstore.transfer.errors import (
    KVTransferCancelled,
    KVTransferError,
    KVTransferExpired,
    KVTransferFailed,
    KVTransferNotFound,
    KVTransferRejected,
)
from pdmesh.kvstore.transfer.handle import KVHandle, log_id
from pdmesh.kvstore.transfer.state import TERMINAL_STATE_FOR, ReleaseReason, TransferState

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ReleaseCallback = Callable[[str, ReleaseReason], None]
Action = Callable[[], None]


@dataclass(frozen=True)
class Grant:
    """What the control plane hands a data-plane server once a transfer started."""

    transfer_id: str
    request_id: str
    backend: str
    token: str
    header: bytes


@dataclass(frozen=True)
class Source:
    """The bytes a data plane streams: the encoded wire header and the pinned tensor."""

    header: bytes
    kv: torch.Tensor


@dataclass
class _Entry:
    handle: KVHandle
    kv: torch.Tensor | None
    header: bytes
    deadline: float
    state: TransferState = TransferState.PENDING
    token: str = ""
    readers: int = 0
    aborts: dict[int, Action] = field(default_factory=dict)
    cleanups: list[Action] = field(default_factory=list)
    reason: ReleaseReason | None = None
    detail: str = ""
    released: bool = False


class LeaseTable:
    def __init__(
        self,
        on_release: ReleaseCallback,
        *,
        max_lease_s: float = 300.0,
        remembered: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._on_release = on_release
        self._max_lease_s = max_lease_s
        self._remembered = remembered
        self._clock = clock
        self._lock = threading.Lock()
        self._live: dict[str, _Entry] = {}
        self._gone: OrderedDict[str, _Entry] = OrderedDict()
        self._reader_ids = 0

    # -- publishing and lease ----------------------------------------------------------------

    def add(self, handle: KVHandle, kv: torch.Tensor | None, header: bytes, lease_s: float
            ) -> None:
        """`kv` None: an export the engine core serves itself (no data plane reads here)."""
        entry = _Entry(handle, kv, header, self._clock() + self._cap(lease_s))
        with self._lock:
            if handle.transfer_id in self._live or handle.transfer_id in self._gone:
                raise KVTransferRejected(f"duplicate transfer {log_id(handle.transfer_id)}")
            self._live[handle.transfer_id] = entry

    def extend(self, transfer_id: str, request_id: str | None, seconds: float) -> float:
        """Push the lease to at least `seconds` from now; returns the seconds remaining."""
        with self._lock:
            entry = self._get(transfer_id, request_id)
            if entry.state.terminal:
                raise _state_error(entry)
            entry.deadline = max(entry.deadline, self._clock() + self._cap(seconds))
            return entry.deadline - self._clock()

    def remaining(self, transfer_id: str) -> float:
        with self._lock:
            entry = self._get(transfer_id, None)
            return 0.0 if entry.state.terminal else max(0.0, entry.deadline - self._clock())

    def expire_due(self) -> float | None:
        """Expire overdue leases; return seconds until the next deadline (None: no live lease)."""
        now = self._clock()
        actions: list[Action] = []
        next_due: float | None = None
        with self._lock:
            for entry in list(self._live.values()):
                if entry.state.terminal:
                    continue
                if entry.deadline <= now:
                    actions += self._terminate(entry, ReleaseReason.EXPIRED, "lease expired")
                else:
                    due = entry.deadline - now
                    next_due = due if next_due is None else min(next_due, due)
        self._run(actions)
        return next_due

    # -- the transfer itself -----------------------------------------------------------------

    def start(self, transfer_id: str, request_id: str, backend: str, lease_s: float) -> Grant:
        """PENDING -> TRANSFERRING for one receiver; the lease covers at least `lease_s`."""
        with self._lock:
            entry = self._get(transfer_id, request_id)
            if entry.state is not TransferState.PENDING:
                raise _state_error(entry)
            if backend not in entry.handle.backends:
                raise KVTransferRejected(
                    f"backend {backend!r} not offered for this transfer",
                    transfer_id=transfer_id, request_id=request_id,
                )
            entry.state = TransferState.TRANSFERRING
            entry.token = secrets.token_hex(16)
            entry.deadline = max(entry.deadline, self._clock() + self._cap(lease_s))
            return Grant(transfer_id, request_id, backend, entry.token, entry.header)

    @contextmanager
    def reading(self, transfer_id: str, token: str, abort: Action) -> Iterator[Source]:
        """Pin the source tensor while a data plane reads it.

        `abort` is called (from another thread, at most once) if the transfer ends meanwhile;
        it must make the reader stop soon, e.g. by closing its socket. Release waits for the
        reader to leave this block either way.
        """
        with self._lock:
            entry = self._get(transfer_id, None)
            if entry.state is not TransferState.TRANSFERRING:
                raise _state_error(entry)
            if not secrets.compare_digest(token.encode(), entry.token.encode()):
                raise KVTransferRejected("bad data-plane token", transfer_id=transfer_id)
            assert entry.kv is not None
            self._reader_ids += 1
            reader_id = self._reader_ids
            entry.readers += 1
            entry.aborts[reader_id] = abort
            source = Source(entry.header, entry.kv)
        try:
            yield source
        finally:
            with self._lock:
                entry.readers -= 1
                entry.aborts.pop(reader_id, None)
                actions = self._release(entry) if entry.state.terminal else []
            self._run(actions)

    def add_cleanup(self, transfer_id: str, cleanup: Action) -> None:
        """Run `cleanup` when the transfer is released (now, if it already was)."""
        with self._lock:
            entry = self._get(transfer_id, None)
            if not entry.released:
                entry.cleanups.append(cleanup)
                return
        self._run([cleanup])

    def complete(
        self, transfer_id: str, request_id: str, ok: bool, error: str = ""
    ) -> TransferState:
        """The receiver's ack (ok) or failure report. A repeated ack is answered DONE."""
        with self._lock:
            entry = self._get(transfer_id, request_id)
            if ok and entry.state is TransferState.DONE:
                return entry.state
            if ok and entry.state is not TransferState.TRANSFERRING:
                raise _state_error(entry)
            if entry.state.terminal:
                return entry.state
            if ok:
                actions = self._terminate(entry, ReleaseReason.ACKED, "acknowledged")
            else:
                actions = self._terminate(
                    entry, ReleaseReason.FAILED, error or "receiver reported failure"
                )
            state = entry.state
        self._run(actions)
        return state

    def cancel(
        self,
        transfer_id: str,
        reason: ReleaseReason = ReleaseReason.CANCELLED,
        *,
        request_id: str | None = None,
        detail: str = "",
    ) -> TransferState:
        """End a live transfer; a terminal one is left as it is. Returns the final state."""
        with self._lock:
            entry = self._get(transfer_id, request_id)
            if entry.state.terminal:
                return entry.state
            actions = self._terminate(entry, reason, detail or str(reason))
            state = entry.state
        self._run(actions)
        return state

    def shutdown(self) -> None:
        with self._lock:
            actions: list[Action] = []
            for entry in list(self._live.values()):
                if not entry.state.terminal:
                    actions += self._terminate(entry, ReleaseReason.SHUTDOWN, "sender shut down")
        self._run(actions)

    # -- inspection --------------------------------------------------------------------------

    def state(self, transfer_id: str) -> TransferState:
        with self._lock:
            return self._get(transfer_id, None).state

    def ended_error(self, transfer_id: str) -> KVTransferError | None:
        """The error describing a transfer's terminal state, or None while it is live."""
        with self._lock:
            entry = self._get(transfer_id, None)
            return _state_error(entry) if entry.state.terminal else None

    def live_count(self) -> int:
        with self._lock:
            return sum(1 for e in self._live.values() if not e.state.terminal)

    def pinned_count(self) -> int:
        """Transfers whose KV is still held (live, or terminal with a reader still inside)."""
        with self._lock:
            return len(self._live)

    # -- internals (call with the lock held unless noted) ------------------------------------

    def _cap(self, seconds: float) -> float:
        return min(max(0.0, float(seconds)), self._max_lease_s)

    def _get(self, transfer_id: str, request_id: str | None) -> _Entry:
        entry = self._live.get(transfer_id) or self._gone.get(transfer_id)
        if entry is None:
            raise KVTransferNotFound(f"unknown transfer {log_id(transfer_id)}",
                                     transfer_id=transfer_id)
        if request_id is not None and request_id != entry.handle.request_id:
            raise KVTransferRejected(
                f"request id {request_id!r} does not own transfer {log_id(transfer_id)}",
                transfer_id=transfer_id, request_id=request_id,
            )
        return entry

    def _terminate(self, entry: _Entry, reason: ReleaseReason, detail: str) -> list[Action]:
        entry.state = TERMINAL_STATE_FOR[reason]
        entry.reason = reason
        entry.detail = detail
        logger.debug("transfer %s -> %s (%s)", log_id(entry.handle.transfer_id),
                     entry.state.name, detail)
        aborts = list(entry.aborts.values())
        entry.aborts.clear()
        return aborts + self._release(entry)

    def _release(self, entry: _Entry) -> list[Action]:
        if entry.released or entry.readers > 0:
            return []
        entry.released = True
        entry.kv = None
        tid = entry.handle.transfer_id
        self._live.pop(tid, None)
        self._gone[tid] = entry
        while len(self._gone) > self._remembered:
            self._gone.popitem(last=False)
        cleanups, entry.cleanups = entry.cleanups, []
        assert entry.reason is not None
        request_id, reason = entry.handle.request_id, entry.reason
        return [*cleanups, lambda: self._on_release(request_id, reason)]

    @staticmethod
    def _run(actions: list[Action]) -> None:
        """Run callbacks outside the lock; one failing must not skip the others."""
        for action in actions:
            try:
                action()
            except Exception:
                logger.exception("KV transfer callback failed")


def _state_error(entry: _Entry) -> KVTransferError:
    """The error for a call that the transfer's current state does not allow."""
    tid, rid = entry.handle.transfer_id, entry.handle.request_id
    detail = f" ({entry.detail})" if entry.detail else ""
    error_type, text = _STATE_ERRORS.get(entry.state, (KVTransferRejected, entry.state.name))
    error = error_type(f"transfer {log_id(tid)} {text}{detail}", transfer_id=tid,
                       request_id=rid)
    error.state = entry.state
    return error


_STATE_ERRORS: dict[TransferState, tuple[type[KVTransferError], str]] = {
    TransferState.EXPIRED: (KVTransferExpired, "expired"),
    TransferState.CANCELLED: (KVTransferCancelled, "was cancelled"),
    TransferState.FAILED: (KVTransferFailed, "failed"),
    TransferState.DONE: (KVTransferRejected, "is already done"),
    TransferState.TRANSFERRING: (KVTransferRejected, "is already being transferred"),
}
