"""The KV transfer under TLS and the cluster token, in one process over real sockets on
127.0.0.1: the tcp data plane speaks (mutual) TLS and refuses plaintext; StartTransfer needs the
token and the router's capability; shm needs proof of sharing the shm directory."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from pdmesh.auth import ClusterToken
from pdmesh.grpc_common import TLSConfig
from pdmesh.kvstore.transfer.capability import TransferCapability
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import KVTransferDenied, KVTransferError
from pdmesh.kvstore.transfer.receiver import KVReceiver, KVReceiverConfig
from pdmesh.kvstore.transfer.sender import KVSender, KVSenderConfig
from pdmesh.kvstore.transfer.state import ReleaseReason, TransferState
from pdmesh.kvstore.transfer.wire import MAGIC
from tests.certs import CertSet, make_test_certs

pytestmark = pytest.mark.fast

T = TypeVar("T")
TOKEN = ClusterToken("k" * 43)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.fixture(name="certs", scope="module")
def certs_fixture(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    return make_test_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(name="shm_dir")
def shm_dir_fixture(tmp_path: Path) -> str:
    directory = tmp_path / "shm"
    directory.mkdir()
    return str(directory)


def _kv(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 2, 3, 4, 1, 8, generator=torch.Generator().manual_seed(seed))


def _raw_request(transfer_id: str, token: str) -> bytes:
    tid = transfer_id.encode()
    return struct.pack("<4sBB", b"PDKQ", len(tid), len(token)) + tid + token.encode()


def _read_all(sock: socket.socket, limit: int = 1 << 20) -> bytes:
    data = b""
    try:
        while len(data) < limit:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (ConnectionError, TimeoutError, ssl.SSLError):
        pass
    return data


def test_tcp_data_plane_is_mutual_tls_and_refuses_plaintext(certs: CertSet, shm_dir: str) -> None:
    released: list[ReleaseReason] = []

    async def go() -> None:
        sender = KVSender(KVSenderConfig(backends=("tcp",), shm_dir=shm_dir),
                          lambda r, w: released.append(w), tls=certs.tls)
        async with sender, KVReceiver(KVReceiverConfig(shm_dir=shm_dir), tls=certs.tls) as rx:
            kv = _kv()
            handle = sender.publish("r-tls", kv, 12)
            assert torch.equal(await rx.fetch(handle, 20), kv)  # mutual TLS end to end

            # Start a second transfer legitimately, then knock on its data port without TLS
            # (with the right one-time token!), and with TLS but no or a rogue certificate.
            handle = sender.publish("r-plain", _kv(1), 12)
            control = rx.control(handle.sender_address)
            reply = await control.start(handle, "tcp", "", 20, Deadline.after(10))
            params = reply.params
            assert params["tls"] == "1"
            address = (params["host"], int(params["port"]))

            def plaintext() -> bytes:
                with socket.create_connection(address, timeout=5) as sock:
                    sock.sendall(_raw_request(handle.transfer_id, params["token"]))
                    return _read_all(sock)

            def tls_client(cert: tuple[Path, Path] | None) -> bytes:
                ctx = ssl.create_default_context(cafile=str(certs.ca))
                if cert is not None:
                    ctx.load_cert_chain(*cert)
                with socket.create_connection(address, timeout=5) as raw:
                    try:
                        sock = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
                        sock.sendall(_raw_request(handle.transfer_id, params["token"]))
                        return _read_all(sock)
                    except (ssl.SSLError, ConnectionError):
                        return b""

            for attempt in (plaintext, lambda: tls_client(None),
                            lambda: tls_client((certs.rogue_cert, certs.rogue_key))):
                data = await asyncio.to_thread(attempt)
                assert MAGIC not in data and len(data) < 512, "KV bytes left without mTLS"
            await control.cancel(handle, "test over", Deadline.after(5))

    run(go())
    assert released == [ReleaseReason.ACKED, ReleaseReason.CANCELLED]


def test_tls_refuses_data_planes_without_tls(certs: CertSet, shm_dir: str) -> None:
    for backend in ("ucxx", "torch_dist"):
        with pytest.raises(ValueError, match="no TLS"):
            KVSender(KVSenderConfig(backends=("tcp", backend), shm_dir=shm_dir),
                     lambda r, w: None, tls=certs.tls)
    rx = KVReceiver(KVReceiverConfig(backends=("ucxx", "tcp", "torch_dist"), shm_dir=shm_dir),
                    tls=certs.tls)
    assert rx._preferences == ("tcp",)
    run(rx.close())


def test_start_transfer_needs_the_token_and_the_routers_capability(shm_dir: str) -> None:
    async def go() -> None:
        sender = KVSender(KVSenderConfig(backends=("tcp",), shm_dir=shm_dir),
                          lambda r, w: None, token=TOKEN)
        async with sender:
            kv = _kv(2)
            handle = sender.publish("r-cap", kv, 12)
            async with KVReceiver(KVReceiverConfig(shm_dir=shm_dir)) as stranger:
                with pytest.raises(KVTransferDenied, match="UNAUTHENTICATED"):
                    await stranger.fetch(handle, 10)
            async with KVReceiver(KVReceiverConfig(shm_dir=shm_dir), token=TOKEN) as rx:
                with pytest.raises(KVTransferDenied, match="no transfer capability"):
                    await rx.fetch(handle, 10)
                other = TransferCapability.mint(TOKEN, "f" * 32, "decode-a")
                with pytest.raises(KVTransferDenied, match="does not match"):
                    await rx.fetch(handle, 10, capability=other)
                assert sender.state(handle.transfer_id) is TransferState.PENDING  # untouched
                granted = TransferCapability.mint(TOKEN, handle.transfer_id, "decode-a")
                assert torch.equal(await rx.fetch(handle, 10, capability=granted), kv)

    run(go())


def test_shm_needs_proof_of_the_same_shm_directory(shm_dir: str, tmp_path: Path) -> None:
    elsewhere = tmp_path / "other-shm"
    elsewhere.mkdir()

    async def go() -> None:
        sender = KVSender(KVSenderConfig(backends=("shm", "tcp"), shm_dir=shm_dir),
                          lambda r, w: None)
        async with sender:
            handle = sender.publish("r-shm", _kv(3), 12)
            async with KVReceiver(KVReceiverConfig(shm_dir=shm_dir)) as local:
                assert local.choose_backend(handle) == "shm"
            # A receiver that cannot read the sender's nonce file: no shm, even if it asks.
            async with KVReceiver(KVReceiverConfig(shm_dir=str(elsewhere))) as remote:
                assert remote.choose_backend(handle) == "tcp"
                with pytest.raises(KVTransferDenied, match="shm is served only"):
                    await remote.fetch(handle, 10, backend="shm")
                control = remote.control(handle.sender_address)
                with pytest.raises(KVTransferError):
                    await control.start(handle, "shm", "0" * 64, 10, Deadline.after(5))
                assert sender.state(handle.transfer_id) is TransferState.PENDING
            async with KVReceiver(KVReceiverConfig(shm_dir=shm_dir)) as local:
                got = await local.fetch(handle, 10)
                assert torch.equal(got, _kv(3))

    run(go())


def test_a_cuda_ipc_plane_is_the_same_host_only_within_its_pid_namespace(
        shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU sender's `shm` is a CUDA IPC handle, which opens only in the PID namespace that
    made it: a receiver in another one (a container sharing /dev/shm, not PIDs) gets tcp."""
    from pdmesh.kvstore.transfer.backends import hostid

    file_plane = hostid.HostChallenge(shm_dir)
    ipc_plane = hostid.HostChallenge(shm_dir, same_pid_namespace=True)
    transfer = "t" * 32
    try:
        for challenge in (file_plane, ipc_plane):
            proof = hostid.host_proof(shm_dir, challenge.key, transfer)
            assert proof is not None and challenge.verify(transfer, proof)
        monkeypatch.setattr(hostid, "pid_namespace", lambda: "4026531999")
        assert hostid.host_proof(shm_dir, file_plane.key, transfer) is not None
        assert hostid.host_proof(shm_dir, ipc_plane.key, transfer) is None
    finally:
        file_plane.close()
        ipc_plane.close()


def test_tls_without_a_ca_still_encrypts(certs: CertSet, shm_dir: str) -> None:
    """cert+key only on the sender, CA only on the receiver: TLS, no client certificates."""
    server = TLSConfig(str(certs.cert), str(certs.key))
    client = TLSConfig(ca=str(certs.ca))

    async def go() -> None:
        sender = KVSender(KVSenderConfig(backends=("tcp",), shm_dir=shm_dir),
                          lambda r, w: None, tls=server)
        async with sender, KVReceiver(KVReceiverConfig(shm_dir=shm_dir), tls=client) as rx:
            kv = _kv(4)
            assert torch.equal(await rx.fetch(sender.publish("r-ca", kv, 12), 20), kv)

    run(go())
