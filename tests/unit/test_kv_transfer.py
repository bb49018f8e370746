"""KV transfer between two real processes over 127.0.0.1, for every backend and failure path.

The sender runs in `kv_peer.py` (a subprocess driven by JSON lines); the receiver runs here.
Both sides generate the KV from the same seed, so results are compared bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdmesh.kvstore.transfer.backends import unavailable_reason
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import (
    KVChecksumError,
    KVSenderUnavailable,
    KVTransferCancelled,
    KVTransferError,
    KVTransferExpired,
    KVTransferTimeout,
)
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.layout import DTYPES_BY_NAME
from pdmesh.kvstore.transfer.receiver import KVReceiver, KVReceiverConfig
from pdmesh.kvstore.transfer.sender import KVSender, KVSenderConfig
from pdmesh.kvstore.transfer.state import ReleaseReason, TransferState

pytestmark = [pytest.mark.e2e, pytest.mark.processes]

PEER = Path(__file__).with_name("kv_peer.py")
UCXX_MISSING = unavailable_reason("ucxx")
BACKENDS = [
    "tcp",
    "shm",
    "torch_dist",
    pytest.param("ucxx", marks=pytest.mark.skipif(UCXX_MISSING is not None,
                                                  reason=str(UCXX_MISSING))),
]
SMALL = {"shape": [3, 2, 5, 16, 2, 8], "num_tokens": 70}  # last block partial (70 of 80)


class Peer:
    """A KV sender process plus the events it reported."""

    def __init__(self, backends: str, shm_dir: str) -> None:
        env = {**os.environ, "UCX_TLS": "tcp,self,sm", "UCX_WARN_UNUSED_ENV_VARS": "n"}
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), "--backends", backends, "--shm-dir", shm_dir],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
            env=env,
        )
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self.wait_for(lambda e: e["event"] == "ready", timeout=60)
        self._seed = 0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.events.append(json.loads(line))
                self._cond.notify_all()

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def wait_for(self, pred: Callable[[dict], bool], timeout: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self.events:
                    if pred(event):
                        return event
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._cond.wait(0.2)):
                    self._stderr.seek(0)
                    raise AssertionError(f"peer event not seen; stderr:\n{self._stderr.read()}")
                self._cond.wait(left)

    def publish(
        self, request_id: str, dtype: str = "float32", lease_s: float | None = None, **layout: Any
    ) -> tuple[KVHandle, torch.Tensor]:
        self._seed += 1
        spec = {**SMALL, **layout}
        self.send(cmd="publish", request_id=request_id, seed=self._seed, dtype=dtype,
                  lease_s=lease_s, **spec)
        event = self.wait_for(
            lambda e: e["event"] == "published" and e["handle"]["request_id"] == request_id
        )
        generator = torch.Generator().manual_seed(self._seed)
        kv = torch.randn(spec["shape"], generator=generator).to(DTYPES_BY_NAME[dtype])
        return KVHandle.from_dict(event["handle"]), kv

    def releases(self, request_id: str) -> list[str]:
        with self._cond:
            return [e["reason"] for e in self.events
                    if e["event"] == "release" and e["request_id"] == request_id]

    def wait_release(self, request_id: str, timeout: float = 20) -> str:
        return self.wait_for(
            lambda e: e["event"] == "release" and e["request_id"] == request_id, timeout
        )["reason"]

    def stop(self) -> dict[str, Any]:
        self.send(cmd="exit")
        summary = self.wait_for(lambda e: e["event"] == "summary", timeout=30)
        self.proc.wait(timeout=30)
        return summary

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._stderr.close()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def fetch(handle: KVHandle, deadline: float = 20, **kwargs: Any) -> torch.Tensor:
    async with KVReceiver(KVReceiverConfig(shm_dir=kwargs.pop("shm_dir", "/dev/shm"))) as rx:
        return await rx.fetch(handle, deadline, **kwargs)


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="pdmesh-kv-test-", dir="/dev/shm") as path:
        yield path


@pytest.fixture(scope="module")
def peer(shm_dir: str) -> Iterator[Peer]:
    """One sender serving every backend; each test uses its own request ids."""
    backends = "shm,tcp,torch_dist" + (",ucxx" if UCXX_MISSING is None else "")
    p = Peer(backends, shm_dir)
    yield p
    summary = p.stop()
    p.kill()
    # Exactly one release per published request, nothing left pinned, no segment leaked.
    assert all(len(reasons) == 1 for reasons in summary["releases"].values()), summary
    assert summary["pinned"] == 0
    assert os.listdir(shm_dir) == []


@pytest.fixture
def lone_peer(shm_dir: str) -> Iterator[Peer]:
    """A sender this test may kill or freeze."""
    p = Peer("tcp,shm", shm_dir)
    yield p
    if p.proc.poll() is None:
        os.kill(p.proc.pid, signal.SIGCONT)
    p.kill()


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_moves_kv_bit_exact(peer: Peer, shm_dir: str, backend: str) -> None:
    cases = [
        peer.publish(f"{backend}-f32", "float32"),
        peer.publish(f"{backend}-bf16", "bfloat16", shape=[2, 2, 3, 16, 3, 64], num_tokens=33),
        peer.publish(f"{backend}-f16", "float16", shape=[1, 2, 1, 16, 1, 8], num_tokens=1),
    ]

    async def go() -> list[torch.Tensor]:
        async with KVReceiver(KVReceiverConfig(shm_dir=shm_dir)) as rx:
            return [await rx.fetch(h, 30, backend=backend) for h, _ in cases]

    for (handle, expected), got in zip(cases, run(go()), strict=True):
        assert got.dtype == expected.dtype
        assert torch.equal(bits(got), bits(expected)), handle.request_id
        assert peer.wait_release(handle.request_id) == ReleaseReason.ACKED
    assert [len(peer.releases(h.request_id)) for h, _ in cases] == [1, 1, 1]


def test_fetch_into_preallocated_tensor(peer: Peer, shm_dir: str) -> None:
    handle, expected = peer.publish("into-out")
    out = torch.full(expected.shape, float("nan"))
    got = run(fetch(handle, out=out, shm_dir=shm_dir, backend="tcp"))
    assert got is out and torch.equal(out, expected)


def test_shm_is_chosen_on_the_same_host_tcp_otherwise(peer: Peer, shm_dir: str) -> None:
    handle, _ = peer.publish("choose")
    prefer = ("shm", "tcp")
    assert KVReceiver(KVReceiverConfig(prefer, shm_dir)).choose_backend(handle) == "shm"
    with tempfile.TemporaryDirectory() as elsewhere:  # another shm namespace, as in a container
        assert KVReceiver(KVReceiverConfig(prefer, elsewhere)).choose_backend(handle) == "tcp"
    run(fetch(handle, shm_dir=shm_dir))
    assert peer.wait_release("choose") == ReleaseReason.ACKED


def test_lease_expiry_releases_and_fetch_fails_clearly(peer: Peer, shm_dir: str) -> None:
    handle, _ = peer.publish("expiring", lease_s=0.3)
    assert peer.wait_release("expiring", timeout=10) == ReleaseReason.EXPIRED
    started = time.monotonic()
    with pytest.raises(KVTransferExpired, match="expired"):
        run(fetch(handle, 5, shm_dir=shm_dir))
    assert time.monotonic() - started < 2
    assert peer.releases("expiring") == ["expired"]


def test_extend_lease(peer: Peer, shm_dir: str) -> None:
    handle, expected = peer.publish("extended", lease_s=2)

    async def go() -> tuple[float, torch.Tensor]:
        async with KVReceiver(KVReceiverConfig(shm_dir=shm_dir)) as rx:
            remaining = await rx.extend_lease(handle, 60)
            return remaining, await rx.fetch(handle, 20)

    remaining, got = run(go())
    assert 50 < remaining <= 60
    assert torch.equal(got, expected)


def test_sender_cancel_before_fetch(peer: Peer, shm_dir: str) -> None:
    handle, _ = peer.publish("cancel-early")
    peer.send(cmd="cancel", transfer_id=handle.transfer_id)
    assert peer.wait_release("cancel-early") == ReleaseReason.CANCELLED
    with pytest.raises(KVTransferCancelled):
        run(fetch(handle, 5, shm_dir=shm_dir))


def test_receiver_cancel_releases_on_sender(peer: Peer, shm_dir: str) -> None:
    handle, _ = peer.publish("cancel-by-decode")

    async def go() -> TransferState:
        async with KVReceiver(KVReceiverConfig(shm_dir=shm_dir)) as rx:
            return await rx.cancel(handle, "request aborted")

    assert run(go()) is TransferState.CANCELLED
    assert peer.wait_release("cancel-by-decode") == ReleaseReason.CANCELLED
    with pytest.raises(KVTransferCancelled):
        run(fetch(handle, 5, shm_dir=shm_dir))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancel_mid_transfer(peer: Peer, shm_dir: str, backend: str) -> None:
    # ~60 MB so the cancel lands while bytes are still moving (or, if the copy wins the race,
    # before the ack): either way the receiver must not get the KV.
    rid = f"cancel-mid-{backend}"
    handle, _ = peer.publish(rid, shape=[30, 2, 64, 16, 2, 64], num_tokens=1024)
    peer.send(cmd="cancel_when_transferring", transfer_id=handle.transfer_id)
    peer.wait_for(lambda e: e["event"] == "armed" and e["transfer_id"] == handle.transfer_id)
    with pytest.raises(KVTransferCancelled):
        run(fetch(handle, 30, shm_dir=shm_dir, backend=backend))
    cancelled = peer.wait_for(
        lambda e: e["event"] == "cancelled" and e["transfer_id"] == handle.transfer_id
    )
    assert cancelled["seen_transferring"] is True
    assert peer.wait_release(rid) == ReleaseReason.CANCELLED
    assert peer.releases(rid) == ["cancelled"]


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_kv_overwritten_after_publish_is_refused(peer: Peer, shm_dir: str, backend: str) -> None:
    rid = f"corrupt-{backend}"
    handle, _ = peer.publish(rid)
    peer.send(cmd="corrupt", transfer_id=handle.transfer_id)
    peer.wait_for(lambda e: e["event"] == "corrupted" and e["transfer_id"] == handle.transfer_id)
    with pytest.raises(KVChecksumError):
        run(fetch(handle, 10, shm_dir=shm_dir, backend=backend))
    assert peer.wait_release(rid) == ReleaseReason.FAILED


def test_sender_killed_before_fetch(lone_peer: Peer, shm_dir: str) -> None:
    handle, _ = lone_peer.publish("orphan")
    lone_peer.kill()
    started = time.monotonic()
    with pytest.raises(KVSenderUnavailable):
        run(fetch(handle, 3, shm_dir=shm_dir))
    assert time.monotonic() - started < 3.5


def test_sender_frozen_fetch_times_out(lone_peer: Peer, shm_dir: str) -> None:
    handle, _ = lone_peer.publish("frozen")
    os.kill(lone_peer.proc.pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(KVTransferTimeout):
        run(fetch(handle, 1.0, shm_dir=shm_dir))
    assert time.monotonic() - started < 1.0 + 2.5  # deadline plus channel teardown


@pytest.mark.parametrize("backend", ["tcp", "torch_dist"])
def test_sender_dies_mid_transfer(shm_dir: str, backend: str) -> None:
    peer = Peer(backend, shm_dir)
    try:
        handle, _ = peer.publish("dying", shape=[30, 2, 64, 16, 2, 64], num_tokens=1024)
        peer.send(cmd="die_when_transferring", transfer_id=handle.transfer_id)
        peer.wait_for(lambda e: e["event"] == "armed")
        started = time.monotonic()
        with pytest.raises(KVTransferError) as info:
            run(fetch(handle, 10, shm_dir=shm_dir, backend=backend))
        # Noticed by the data plane or the lease heartbeat, well before the 10 s deadline.
        assert isinstance(info.value, KVSenderUnavailable), info.value
        assert time.monotonic() - started < 5
        peer.proc.wait(timeout=10)
        assert peer.proc.returncode == -signal.SIGKILL
    finally:
        peer.kill()


# -- in-process checks (both halves in this process, still real sockets) -----------------


def test_heartbeat_extends_the_lease_and_reports_a_cancel(shm_dir: str) -> None:
    async def go() -> tuple[float, float, BaseException | None, float]:
        sender = KVSender(KVSenderConfig(backends=("tcp",), shm_dir=shm_dir), lambda r, w: None)
        async with sender, KVReceiver(KVReceiverConfig(shm_dir=shm_dir, heartbeat_s=0.05)) as rx:
            handle = sender.publish("beat", torch.zeros(1, 2, 1, 4, 1, 2), 4, lease_s=1)
            before = sender._table.remaining(handle.transfer_id)
            beat = asyncio.ensure_future(
                rx.heartbeat(rx.control(handle.sender_address), handle, Deadline.after(30))
            )
            deadline = time.monotonic() + 10
            while sender._table.remaining(handle.transfer_id) < 20 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # poll with a deadline
            extended = sender._table.remaining(handle.transfer_id)
            sender.cancel(handle.transfer_id)
            cancelled_at = time.monotonic()
            done, _ = await asyncio.wait({beat}, timeout=5)
            error = beat.exception() if done else None
            beat.cancel()
            return before, extended, error, time.monotonic() - cancelled_at

    before, extended, error, noticed_after = run(go())
    assert before <= 1 < 20 <= extended
    assert isinstance(error, KVTransferCancelled)
    assert noticed_after < 1


def test_stop_releases_everything_with_shutdown(shm_dir: str) -> None:
    released: list[tuple[str, ReleaseReason]] = []

    async def go() -> None:
        sender = KVSender(KVSenderConfig(shm_dir=shm_dir), lambda r, w: released.append((r, w)))
        await sender.start()
        for i in range(3):
            sender.publish(f"r{i}", torch.zeros(1, 2, 1, 4, 1, 2), 4)
        await sender.stop()

    run(go())
    assert sorted(released) == [(f"r{i}", ReleaseReason.SHUTDOWN) for i in range(3)]


def _make_certs(directory: Path) -> dict[str, bytes]:
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True,
                       timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "1", "-subj", "/CN=pdmesh-test-ca")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                f"{name}.csr", "-subj", f"/CN={name}")
        (directory / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile",
                f"{name}.ext")
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_mtls_control_channel(tmp_path: Path, shm_dir: str) -> None:
    import grpc

    certs = _make_certs(tmp_path)
    server_creds = grpc.ssl_server_credentials(
        [(certs["server.key"], certs["server.pem"])], root_certificates=certs["ca.pem"],
        require_client_auth=True,
    )
    client_creds = grpc.ssl_channel_credentials(
        certs["ca.pem"], certs["client.key"], certs["client.pem"]
    )
    released: list[str] = []

    async def go() -> tuple[torch.Tensor, torch.Tensor, Exception | None]:
        sender = KVSender(KVSenderConfig(backends=("tcp",), shm_dir=shm_dir),
                          lambda r, w: released.append(str(w)), server_credentials=server_creds)
        async with sender:
            kv = torch.randn(2, 2, 2, 4, 1, 8)
            handle = sender.publish("tls", kv, 8)
            plain_error = None
            async with KVReceiver(KVReceiverConfig(shm_dir=shm_dir)) as rx:
                try:
                    await rx.fetch(handle, 3)
                except KVTransferError as exc:
                    plain_error = exc
            async with KVReceiver(KVReceiverConfig(shm_dir=shm_dir),
                                  channel_credentials=client_creds) as rx:
                return kv, await rx.fetch(handle, 10), plain_error

    kv, got, plain_error = run(go())
    assert isinstance(plain_error, KVSenderUnavailable | KVTransferTimeout)
    assert torch.equal(kv, got)
    assert released == ["acked"]
