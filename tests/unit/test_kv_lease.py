"""Lease rules of the KV sender: exactly-once release, pinning while read, clear errors."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
import torch

from pdmesh.kvstore.transfer.checksum import ChecksumAlgo
from pdmesh.kvstore.transfer.errors import (
    KVTransferCancelled,
    KVTransferExpired,
    KVTransferNotFound,
    KVTransferRejected,
)
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.layout import KVLayout
from pdmesh.kvstore.transfer.lease import LeaseTable
from pdmesh.kvstore.transfer.state import ReleaseReason, TransferState

pytestmark = pytest.mark.fast


@dataclass
class Clock:
    """Manual monotonic clock: tests move time explicitly instead of sleeping."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Releases:
    calls: list[tuple[str, ReleaseReason]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, request_id: str, reason: ReleaseReason) -> None:
        with self.lock:
            self.calls.append((request_id, reason))


def handle(n: int = 0, request_id: str = "req") -> KVHandle:
    return KVHandle(
        transfer_id=f"{n:032x}",
        request_id=request_id,
        sender_address="127.0.0.1:1",
        backends=("tcp",),
        host_key="h",
        sender_id="s",
        layout=KVLayout(1, 1, 4, 1, 2, torch.float32, 4),
        checksum_algo=ChecksumAlgo.CRC32,
        checksum=0,
    )


def table_with(n: int = 1, lease_s: float = 10.0) -> tuple[LeaseTable, Releases, Clock]:
    releases, clock = Releases(), Clock()
    table = LeaseTable(releases, clock=clock)
    for i in range(n):
        table.add(handle(i, f"req-{i}"), torch.zeros(1, 2, 1, 4, 1, 2), b"hdr", lease_s)
    return table, releases, clock


TID = handle(0).transfer_id


def test_ack_releases_once() -> None:
    table, releases, _ = table_with()
    grant = table.start(TID, "req-0", "tcp", 5)
    with table.reading(TID, grant.token, abort=lambda: None) as src:
        assert src.header == b"hdr"
    assert table.complete(TID, "req-0", ok=True) is TransferState.DONE
    assert table.complete(TID, "req-0", ok=True) is TransferState.DONE  # a retried ack
    assert table.cancel(TID) is TransferState.DONE
    assert releases.calls == [("req-0", ReleaseReason.ACKED)]
    assert table.pinned_count() == 0


def test_expiry_releases_and_later_calls_say_expired() -> None:
    table, releases, clock = table_with(lease_s=2)
    clock.now += 1
    assert table.expire_due() == pytest.approx(1)
    assert releases.calls == []
    clock.now += 1
    assert table.expire_due() is None
    assert releases.calls == [("req-0", ReleaseReason.EXPIRED)]
    with pytest.raises(KVTransferExpired) as info:
        table.start(TID, "req-0", "tcp", 5)
    assert info.value.state is TransferState.EXPIRED
    with pytest.raises(KVTransferExpired):
        table.extend(TID, "req-0", 5)
    with pytest.raises(KVTransferExpired):
        table.complete(TID, "req-0", ok=True)
    assert table.expire_due() is None
    assert len(releases.calls) == 1


def test_extend_moves_the_deadline_forward_only() -> None:
    table, releases, clock = table_with(lease_s=2)
    assert table.extend(TID, "req-0", 10) == pytest.approx(10)
    assert table.extend(TID, "req-0", 1) == pytest.approx(10)  # never shortens
    clock.now += 9
    table.expire_due()
    assert releases.calls == []
    clock.now += 1
    table.expire_due()
    assert releases.calls == [("req-0", ReleaseReason.EXPIRED)]


def test_lease_is_capped() -> None:
    releases, clock = Releases(), Clock()
    table = LeaseTable(releases, clock=clock, max_lease_s=5)
    table.add(handle(), torch.zeros(1), b"", 1000)
    assert table.remaining(TID) == pytest.approx(5)


@pytest.mark.parametrize("end", ["cancel", "expire"])
def test_release_waits_for_the_reader(end: str) -> None:
    table, releases, clock = table_with(lease_s=2)
    grant = table.start(TID, "req-0", "tcp", 0)
    aborted = threading.Event()
    with table.reading(TID, grant.token, abort=aborted.set):
        if end == "cancel":
            table.cancel(TID, detail="request aborted")
        else:
            clock.now += 3
            table.expire_due()
        assert aborted.is_set()
        # The KV must stay pinned while the stream may still read it.
        assert releases.calls == []
        assert table.pinned_count() == 1
    reason = ReleaseReason.CANCELLED if end == "cancel" else ReleaseReason.EXPIRED
    assert releases.calls == [("req-0", reason)]
    assert table.pinned_count() == 0


def test_wrong_request_backend_token_and_double_start_are_rejected() -> None:
    table, releases, _ = table_with()
    with pytest.raises(KVTransferRejected, match="does not own"):
        table.start(TID, "someone-else", "tcp", 5)
    with pytest.raises(KVTransferRejected, match="not offered"):
        table.start(TID, "req-0", "shm", 5)
    grant = table.start(TID, "req-0", "tcp", 5)
    with pytest.raises(KVTransferRejected, match="already being transferred"):
        table.start(TID, "req-0", "tcp", 5)
    bad_token = "0" * 32
    with pytest.raises(KVTransferRejected, match="token"), table.reading(TID, bad_token, print):
        pass
    with pytest.raises(KVTransferNotFound):
        table.start("f" * 32, "req-0", "tcp", 5)
    assert grant.token and releases.calls == []


def test_reading_refused_unless_transferring() -> None:
    table, _, _ = table_with()
    with pytest.raises(KVTransferRejected, match="PENDING"), table.reading(TID, "", abort=print):
        pass
    table.cancel(TID)
    with pytest.raises(KVTransferCancelled), table.reading(TID, "", abort=print):
        pass


def test_failure_report_releases_with_failed() -> None:
    table, releases, _ = table_with()
    table.start(TID, "req-0", "tcp", 5)
    assert table.complete(TID, "req-0", ok=False, error="checksum") is TransferState.FAILED
    assert releases.calls == [("req-0", ReleaseReason.FAILED)]


def test_shutdown_releases_everything_live() -> None:
    table, releases, _ = table_with(n=3)
    table.start(TID, "req-0", "tcp", 5)
    table.complete(TID, "req-0", ok=True)
    table.shutdown()
    assert sorted(releases.calls) == [
        ("req-0", ReleaseReason.ACKED),
        ("req-1", ReleaseReason.SHUTDOWN),
        ("req-2", ReleaseReason.SHUTDOWN),
    ]


def test_cleanups_run_on_release_or_at_once_after() -> None:
    table, _, _ = table_with()
    ran: list[str] = []
    table.add_cleanup(TID, lambda: ran.append("before"))
    table.cancel(TID)
    assert ran == ["before"]
    table.add_cleanup(TID, lambda: ran.append("after"))
    assert ran == ["before", "after"]


def test_failing_callback_does_not_break_the_table() -> None:
    def explode(request_id: str, reason: ReleaseReason) -> None:
        raise RuntimeError("callback bug")

    table = LeaseTable(explode)
    table.add(handle(), torch.zeros(1), b"", 10)
    assert table.cancel(TID) is TransferState.CANCELLED
    assert table.state(TID) is TransferState.CANCELLED


def test_racing_endings_release_exactly_once() -> None:
    """Ack, failure, cancel and expiry from many threads: one winner, one release each."""
    n = 200
    table, releases, clock = table_with(n=n, lease_s=1)
    tids = [handle(i).transfer_id for i in range(n)]
    for i, tid in enumerate(tids):
        table.start(tid, f"req-{i}", "tcp", 0)
    clock.now += 2  # every lease is overdue: expiry competes too
    barrier = threading.Barrier(4)

    def run(action: str) -> None:
        barrier.wait(timeout=10)
        for i, tid in enumerate(tids):
            if action == "ack":
                table.complete(tid, f"req-{i}", ok=False)
            elif action == "cancel":
                table.cancel(tid)
            elif action == "expire":
                table.expire_due()
            else:
                table.shutdown()

    threads = [threading.Thread(target=run, args=(a,)) for a in ("ack", "cancel", "expire", "x")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    released = [rid for rid, _ in releases.calls]
    assert sorted(released) == sorted(f"req-{i}" for i in range(n))
    assert table.pinned_count() == 0
