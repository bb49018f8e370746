"""The engine cores' TCP block transport over real sockets on 127.0.0.1: blocks go from the
sender's cache blocks into the receiver's, on one or several connections, plain or TLS; pulls
without a valid grant, replays, ranges outside the export and layout mismatches are refused."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from pdmesh.kvstore.connector import grant_mac, tcp_blocks
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.exports import Export, ExportRegistry
from pdmesh.kvstore.connector.tcp_blocks import BlockServer, connection_ranges, pull_blocks
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import (
    KVSenderUnavailable,
    KVTransferDenied,
    KVTransferTimeout,
    KVWireError,
)
from tests.certs import CertSet, make_test_certs

pytestmark = pytest.mark.fast

KEY = grant_mac.new_key()
SHAPE = (3, 2, 40, 4, 2, 8)  # layers, K/V, blocks, block_size, kv_heads, head_dim
# Non-consecutive on purpose: runs of 1, 2 and longer.
EXPORTED = (5, 6, 7, 9, 2, 3, 30, 31, 32, 33, 34, 35, 36, 37, 0, 11, 12, 13, 14, 15, 16,
            17, 18, 19, 20, 22, 24, 25, 26, 27)


def _cache(dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=gen).to(dtype=dtype, device=device)


def _config(**kwargs: Any) -> KVConnectorConfig:
    return KVConnectorConfig(grant_secret=KEY, io_timeout_s=10.0, **kwargs)


class Sender:
    def __init__(self, cache: torch.Tensor, config: KVConnectorConfig) -> None:
        self.cache, self.exports = cache, ExportRegistry()
        self.exports.add(Export("req", EXPORTED, num_tokens=len(EXPORTED) * SHAPE[3]))
        self.server = BlockServer(cache, self.exports, config)
        self.address = self.server.start()


@pytest.fixture(name="sender")
def sender_fixture() -> Iterator[Sender]:
    sender = Sender(_cache(torch.float32), _config())
    yield sender
    sender.server.close()


def _pull(address: str, dst: torch.Tensor, dst_ids: list[int], *, first: int = 0,
          grant: str = "g1", mac: str | None = None, request_id: str = "req",
          config: KVConnectorConfig | None = None, timeout_s: float = 10.0) -> int:
    return pull_blocks(
        address, request_id=request_id, transfer_id="t1", grant=grant,
        mac=grant_mac.sign(KEY, request_id, "t1", grant) if mac is None else mac,
        first_block=first, dst=dst, dst_ids=dst_ids, config=config or _config(),
        deadline=Deadline.after(timeout_s))


def _dst_ids(n: int) -> list[int]:
    """Non-consecutive destinations, in an order unlike the source's."""
    return [39 - 2 * i if i < 15 else i - 15 for i in range(n)]


def _check(src: torch.Tensor, src_ids: tuple[int, ...], dst: torch.Tensor,
           dst_ids: list[int]) -> None:
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(dst[:, :, d].view(torch.uint8), src[:, :, s].view(torch.uint8)), (s, d)
    untouched = sorted(set(range(SHAPE[2])) - set(dst_ids))
    assert not dst[:, :, untouched].any()


def test_connection_ranges_split_only_big_pulls() -> None:
    assert connection_ranges(7, 4) == [(0, 7)]
    assert connection_ranges(16, 4) == [(0, 8), (8, 8)]
    assert connection_ranges(26, 3) == [(0, 9), (9, 9), (18, 8)]
    assert connection_ranges(1000, 2) == [(0, 500), (500, 500)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("connections", [1, 3])
def test_pull_lands_each_block_in_its_destination(dtype: torch.dtype, connections: int) -> None:
    sender = Sender(_cache(dtype, seed=1), _config())
    try:
        dst = torch.zeros(SHAPE, dtype=dtype)
        ids = _dst_ids(26)
        nbytes = _pull(sender.address, dst, ids, first=2,
                       config=_config(tcp_connections=connections))
        assert nbytes == 26 * 3 * 2 * 4 * 2 * 8 * dst.element_size()
        _check(sender.cache, EXPORTED[2:28], dst, ids)
        # Every sub-range was served under the grant: the whole range is now spent.
        with pytest.raises(KVTransferDenied, match="already served"):
            _pull(sender.address, torch.zeros(SHAPE, dtype=dtype), [0], first=27)
    finally:
        sender.server.close()


def test_a_replayed_or_overlapping_pull_is_denied(sender: Sender) -> None:
    dst = torch.zeros(SHAPE)
    _pull(sender.address, dst, [1, 2, 3], first=4)
    with pytest.raises(KVTransferDenied, match="already served"):
        _pull(sender.address, torch.zeros(SHAPE), [1, 2, 3], first=4)
    with pytest.raises(KVTransferDenied, match="already served"):
        _pull(sender.address, torch.zeros(SHAPE), [7, 8], first=6)
    # Another grant (a new transfer granted by the control plane) may pull them again.
    again = torch.zeros(SHAPE)
    _pull(sender.address, again, [1, 2, 3], first=4, grant="g2")
    _check(sender.cache, EXPORTED[4:7], again, [1, 2, 3])


def test_pulls_without_a_valid_grant_are_denied(sender: Sender) -> None:
    dst = torch.zeros(SHAPE)
    for mac in ("0" * 64, "", "é" * 64, grant_mac.sign(KEY, "req", "t1", "other")):
        with pytest.raises(KVTransferDenied, match="signature"):
            _pull(sender.address, dst, [0], mac=mac)
    with pytest.raises(KVTransferDenied, match="no export"):
        _pull(sender.address, dst, [0], request_id="unknown")
    with pytest.raises(KVTransferDenied, match="outside"):
        _pull(sender.address, dst, [0, 1], first=len(EXPORTED) - 1)
    assert not dst.any()
    # A server without a key denies everything.
    keyless = BlockServer(sender.cache, sender.exports, KVConnectorConfig())
    try:
        with pytest.raises(KVTransferDenied, match="signature"):
            _pull(keyless.start(), dst, [0])
    finally:
        keyless.close()


@pytest.mark.parametrize("dst", [torch.zeros(3, 2, 40, 4, 2, 16), torch.zeros(3, 2, 40, 8, 2, 8),
                                 torch.zeros(SHAPE, dtype=torch.float16)])
def test_a_layout_mismatch_is_refused(sender: Sender, dst: torch.Tensor) -> None:
    with pytest.raises(KVWireError, match="layout mismatch"):
        _pull(sender.address, dst, [0])
    assert not dst.any()


def test_garbage_does_not_hurt_the_server(sender: Sender) -> None:
    body = msgspec.msgpack.encode({"request_id": "req"})
    for junk in (b"GET / HTTP/1.1\r\n\r\n", struct.pack("<4sBI", b"PDBQ", 9, 0),
                 struct.pack("<4sBI", b"PDBQ", 1, 1 << 20),
                 struct.pack("<4sBI", b"PDBQ", 1, len(body)) + body,
                 struct.pack("<4sBI", b"PDBQ", 1, 3) + b"\xc1\xc1\xc1", b"PD"):
        with socket.create_connection(("127.0.0.1", int(sender.address.split(":")[1])),
                                      timeout=10) as raw:
            reply = b""
            with contextlib.suppress(OSError):  # the server may close (reset) first
                raw.sendall(junk)
                raw.shutdown(socket.SHUT_WR)
                reply = raw.recv(4096)
        assert reply == b"" or reply[:5] == b"PDBR\x02", (junk, reply)
    dst = torch.zeros(SHAPE)
    _pull(sender.address, dst, [3], first=1)
    _check(sender.cache, EXPORTED[1:2], dst, [3])


def test_device_staging_cuts_runs_into_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device path (a host buffer of a few blocks, runs cut to fit it) on CPU caches."""
    def stage(cache: torch.Tensor, count: int) -> tuple[torch.Tensor, int]:
        blocks = min(count, 3)
        return torch.full((blocks * cache[0, 0, 0].numel(),), 7, dtype=cache.dtype), blocks

    monkeypatch.setattr(tcp_blocks, "_stage", stage)
    sender = Sender(_cache(torch.bfloat16, seed=4), _config())
    try:
        dst = torch.zeros(SHAPE, dtype=torch.bfloat16)
        ids = _dst_ids(24)
        _pull(sender.address, dst, ids, first=3, config=_config(tcp_connections=3))
        _check(sender.cache, EXPORTED[3:27], dst, ids)
    finally:
        sender.server.close()


def test_one_denied_connection_fails_the_whole_pull(sender: Sender) -> None:
    # The third of three sub-ranges, [18, 26), was already served under this grant.
    _pull(sender.address, torch.zeros(SHAPE), list(range(8)), first=18)
    with pytest.raises(KVTransferDenied, match="already served"):
        _pull(sender.address, torch.zeros(SHAPE), _dst_ids(26),
              config=_config(tcp_connections=3))


def _fake_server(reply: bytes, listener: socket.socket) -> None:
    listener.settimeout(10)
    conn, _ = listener.accept()
    with conn:
        _, _, length = struct.unpack("<4sBI", _recv_exact(conn, 9))
        _recv_exact(conn, length)  # all of it: unread bytes would make close() a reset
        conn.sendall(reply)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        assert chunk
        data += chunk
    return data


@pytest.mark.parametrize(("reply", "error"), [
    (struct.pack("<4sBHQ", b"PDBR", 0, 0, 3 * 2 * 256), KVSenderUnavailable),  # drops early
    (struct.pack("<4sBHQ", b"PDBR", 0, 0, 99), KVWireError),  # a size the layout disagrees with
    (struct.pack("<4sBHQ", b"HTTP", 0, 0, 0), KVWireError),
    (b"PDB", KVWireError),
])
def test_a_misbehaving_server_fails_the_pull(reply: bytes, error: type[Exception]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        server = threading.Thread(target=_fake_server, args=(reply + b"x" * 100, listener))
        server.start()
        try:
            with pytest.raises(error):
                _pull(f"127.0.0.1:{listener.getsockname()[1]}", torch.zeros(SHAPE), [0])
        finally:
            server.join()


def test_close_does_not_wait_for_silent_clients() -> None:
    sender = Sender(_cache(torch.float32), _config())
    port = int(sender.address.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)), \
            socket.create_connection(("127.0.0.1", port)):
        start = time.monotonic()
        sender.server.close()
        assert time.monotonic() - start < 2.0


def test_a_closed_server_is_unavailable() -> None:
    sender = Sender(_cache(torch.float32), _config())
    sender.server.close()
    with pytest.raises(KVSenderUnavailable):
        _pull(sender.address, torch.zeros(SHAPE), [0])


def test_a_silent_server_times_out_at_the_deadline() -> None:
    # A listener nobody accepts from: the kernel completes the handshake, nothing answers.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        for connections in (1, 2):
            dst = torch.zeros(SHAPE)
            start = time.monotonic()
            with pytest.raises(KVTransferTimeout):
                _pull(address, dst, _dst_ids(16), timeout_s=0.3,
                      config=_config(tcp_connections=connections))
            assert 0.25 < time.monotonic() - start < 3.0
            assert not dst.any()


@pytest.fixture(name="certs", scope="module")
def certs_fixture(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    return make_test_certs(tmp_path_factory.mktemp("certs"))


def _tls(certs: CertSet, cert: Path | None = None, key: Path | None = None) -> dict[str, str]:
    return {"tls_cert": str(cert or certs.cert), "tls_key": str(key or certs.key),
            "tls_ca": str(certs.ca)}


def test_mutual_tls_round_trip_and_refusals(certs: CertSet) -> None:
    sender = Sender(_cache(torch.bfloat16, seed=2), _config(**_tls(certs)))
    try:
        dst = torch.zeros(SHAPE, dtype=torch.bfloat16)
        ids = _dst_ids(20)
        _pull(sender.address, dst, ids, config=_config(tcp_connections=2, **_tls(certs)))
        _check(sender.cache, EXPORTED[:20], dst, ids)
        # Plaintext, and a client certificate from a CA the server does not trust, fail the
        # handshake before a byte of KV is sent.
        other = torch.zeros(SHAPE, dtype=torch.bfloat16)
        with pytest.raises(KVSenderUnavailable):
            _pull(sender.address, other, [0], first=25)
        with pytest.raises(KVSenderUnavailable):
            _pull(sender.address, other, [0], first=25,
                  config=_config(**_tls(certs, certs.rogue_cert, certs.rogue_key)))
        assert not other.any()
        _pull(sender.address, other, [0], first=25, config=_config(**_tls(certs)))
        _check(sender.cache, EXPORTED[25:26], other, [0])
    finally:
        sender.server.close()


def test_a_tls_client_never_falls_back_to_plaintext(certs: CertSet, sender: Sender) -> None:
    with pytest.raises(KVSenderUnavailable):
        _pull(sender.address, torch.zeros(SHAPE), [0], config=_config(**_tls(certs)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("connections", [1, 3])
def test_device_caches_are_staged_through_the_host(connections: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A staging buffer of 3 blocks, so runs are cut into pieces on both sides.
    monkeypatch.setattr(tcp_blocks, "STAGE_BYTES", 3 * 4 * 2 * 8 * 2)
    sender = Sender(_cache(torch.bfloat16, seed=3, device="cuda"), _config())
    try:
        dst = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda")
        ids = _dst_ids(26)
        _pull(sender.address, dst, ids, first=2, config=_config(tcp_connections=connections))
        _check(sender.cache.cpu(), EXPORTED[2:28], dst.cpu(), ids)
    finally:
        sender.server.close()
