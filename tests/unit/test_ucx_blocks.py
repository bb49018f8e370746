"""The engine cores' UCX block transport (`ucxx`) between two real connectors on 127.0.0.1:
blocks go from the sender core's cache into the receiver core's, checked block by block; a
wrong or reused grant, a block outside the export and a silent sender past the deadline are
refused. Skipped where ucxx is not installed (the piece arithmetic is checked everywhere)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pdmesh.kvstore.connector import grant_mac, ucx_blocks
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.connector import KVConnector
from pdmesh.kvstore.connector.source import KVSource
from pdmesh.kvstore.transfer.errors import (
    KVSenderUnavailable,
    KVTransferDenied,
    KVTransferTimeout,
    KVWireError,
)
from pdmesh.kvstore.transfer.layout import DTYPE_NAMES
from pdmesh.kvstore.transfer.worker_planes import CoreCache, Exports, core_backends

pytestmark = pytest.mark.fast

needs_ucxx = pytest.mark.skipif(ucx_blocks.unavailable_reason() is not None,
                                reason="needs the ucxx package")
SHAPE = (3, 2, 40, 4, 2, 8)  # layers, K/V, blocks, block_size, kv_heads, head_dim
# Non-consecutive on purpose: runs of 1, 2 and longer.
EXPORTED = [5, 6, 7, 9, 2, 3, 30, 31, 32, 33, 34, 35, 36, 37, 0, 11, 12, 13, 14, 15, 16, 17]
TOKENS = len(EXPORTED) * SHAPE[3] - 1  # the last block is partly filled


def test_pieces_cut_both_sides_runs() -> None:
    assert ucx_blocks.run_lengths([5, 6, 7, 9, 2, 3]) == [3, 1, 2]
    assert ucx_blocks.merge_cuts([3, 1, 2], [2, 4]) == [2, 1, 1, 2]
    assert ucx_blocks.merge_cuts([6], [6]) == [6]


def test_fragmented_pulls_are_staged_and_long_runs_go_direct() -> None:
    """Few pieces go as they lie (no copy); from STAGE_MIN_PIECES pieces per (layer, K/V)
    each layer goes gathered in one message."""
    assert ucx_blocks.plan([30, 31, 32, 33], [4]) == ucx_blocks.UcxPlan([4], staged=False)
    assert ucx_blocks.plan([5, 6, 7, 9, 2, 3], [6]) == ucx_blocks.UcxPlan([3, 1, 2], False)
    shuffled = ucx_blocks.plan([9, 3, 7, 1], [1, 1, 1, 1])
    assert shuffled.pieces == [1, 1, 1, 1] and shuffled.staged
    assert ucx_blocks.plan([0, 1, 2, 3], [1, 1, 1, 1]).staged  # the receiver's side counts
    assert not ucx_blocks.plan([9, 3, 7, 1], [1, 1, 1, 1], stage=False).staged  # a device


def test_a_plan_staged_against_the_receivers_word_is_refused() -> None:
    import msgspec

    pull = ucx_blocks.UcxPull("r", "t", "g", "m", 0, 4, (3, 4, 2, 8), "float32",
                              [1, 1, 1, 1], stage=False)
    with pytest.raises(KVWireError, match="cannot stage"):
        ucx_blocks._checked_plan(msgspec.msgpack.encode(
            ucx_blocks.UcxPlan([1, 1, 1, 1], staged=True)), pull)


def test_a_staged_payload_lands_in_the_destination_blocks() -> None:
    """What a staged pull moves: the sender's gather, in pull order, is exactly what the
    receiver's scatter puts back (checked without UCX between them)."""
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(SHAPE, generator=gen)
    dst = torch.zeros(SHAPE)
    src_ids, dst_ids = [9, 3, 7, 30, 31], [0, 39, 5, 6, 20]
    staged = torch.empty(ucx_blocks.staged_shape(src, len(src_ids)))
    ucx_blocks.scatter(dst, dst_ids, ucx_blocks.gathered(src, src_ids, staged))
    _check(src, src_ids, dst, dst_ids)


def test_core_backends_offer_ucxx_only_with_a_listener() -> None:
    assert "ucxx" not in core_backends("", "127.0.0.1:1")
    assert core_backends("", "", ucx_server="127.0.0.1:2") == ("ucxx",)


def test_without_ucxx_the_core_offers_no_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ucx_blocks, "unavailable_reason", lambda: "not installed here")
    connector = _connector(torch.zeros(SHAPE))
    try:
        assert connector.ucx_address == ""
        assert "ucxx" not in core_backends("", "", ucx_server=connector.ucx_address)
    finally:
        connector.close()


def _config(**kwargs: Any) -> KVConnectorConfig:
    return KVConnectorConfig(shared_cache=False, tcp=False, ucx=True,
                             grant_secret=grant_mac.new_key(), io_timeout_s=10.0, **kwargs)


def _connector(cache: torch.Tensor) -> KVConnector:
    connector = KVConnector(_config(), cache, None)
    connector.start()
    return connector


@pytest.fixture(name="sender")
def sender_fixture() -> Iterator[KVConnector]:
    gen = torch.Generator().manual_seed(3)
    sender = _connector(torch.randn(SHAPE, generator=gen))
    yield sender
    sender.close()


def _source(sender: KVConnector, checksums: list[int], *, grant: str = "g1",
            mac: str | None = None, deadline_s: float = 20.0,
            address: str | None = None) -> KVSource:
    key = sender.config.grant_secret
    params = {"address": address or sender.ucx_address, "request": "req", "transfer": "t1",
              "grant": grant, "mac": grant_mac.sign(key, "req", "t1", grant) if mac is None
              else mac}
    return KVSource("ucxx", params, checksums, str(sender.algo), TOKENS,
                    (SHAPE[0], *SHAPE[3:]), DTYPE_NAMES[sender.cache.dtype],
                    deadline_s=deadline_s)


def _check(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor,
           dst_ids: list[int]) -> None:
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(dst[:, :, d].cpu(), src[:, :, s].cpu()), (s, d)
    untouched = sorted(set(range(SHAPE[2])) - set(dst_ids))
    assert not dst[:, :, untouched].any()


@needs_ucxx
def test_blocks_move_core_to_core_over_ucx(sender: KVConnector) -> None:
    """A fragmented pull (staged), then a short one (direct)."""
    info = sender.export("req", EXPORTED, TOKENS)
    receiver = _connector(torch.zeros(SHAPE))
    try:
        assert sender.ucx_address.startswith("127.0.0.1:")
        dst_ids = [39 - 2 * i if i < 12 else i - 12 for i in range(len(EXPORTED) - 2)]
        source = _source(sender, info.block_checksums)
        nbytes = receiver.load(source, 2, dst_ids)
        assert nbytes == len(dst_ids) * 3 * 2 * 4 * 2 * 8 * 4
        _check(sender.cache, EXPORTED[2:], receiver.cache, dst_ids)
        # The grant is spent on those blocks; the two it did not cover are still free.
        with pytest.raises(KVTransferDenied, match="already served"):
            receiver.load(source, 2, [0])
        assert receiver.load(source, 0, [38, 36]) == 2 * nbytes // len(dst_ids)
        assert ucx_blocks.STAGING.in_use == 0 and ucx_blocks.STAGING.kept_bytes > 0
    finally:
        receiver.close()


@needs_ucxx
def test_consecutive_blocks_go_direct_and_land_the_same(sender: KVConnector) -> None:
    info = sender.export("req", EXPORTED, TOKENS)
    receiver = _connector(torch.zeros(SHAPE))
    try:
        assert not ucx_blocks.plan(EXPORTED[6:14], [8]).staged
        receiver.load(_source(sender, info.block_checksums), 6, list(range(20, 28)))
        _check(sender.cache, EXPORTED[6:14], receiver.cache, list(range(20, 28)))
    finally:
        receiver.close()


@needs_ucxx
def test_a_wrong_grant_a_reused_one_and_blocks_outside_the_export_are_denied(
        sender: KVConnector) -> None:
    info = sender.export("req", EXPORTED, TOKENS)
    receiver = _connector(torch.zeros(SHAPE))
    try:
        with pytest.raises(KVTransferDenied, match="signature"):
            receiver.load(_source(sender, info.block_checksums, mac="0" * 64), 0, [1, 2])
        source = _source(sender, info.block_checksums)
        receiver.load(source, 0, [1, 2])
        with pytest.raises(KVTransferDenied, match="already served"):
            receiver.load(source, 1, [3])
        sender.release("req")
        sender.export("req", EXPORTED[:4], 4 * SHAPE[3])
        with pytest.raises(KVTransferDenied, match="outside the export"):
            receiver.load(_source(sender, info.block_checksums, grant="g2"), 3, [5, 6])
        assert not receiver.cache[:, :, 5:7].any()
    finally:
        receiver.close()


@needs_ucxx
def test_a_silent_sender_is_cut_at_the_deadline(sender: KVConnector) -> None:
    """A listener that accepts and never answers: the pull ends at its deadline."""
    release = asyncio.Event()

    async def silent(ep: Any) -> None:
        await release.wait()
        ep.abort()

    async def listen() -> Any:
        from pdmesh.kvstore.transfer.backends.ucx import ucxx_runtime

        return ucxx_runtime().create_listener(silent, port=0)

    listener = ucx_blocks._EventLoop.run(listen()).result()
    info = sender.export("req", EXPORTED, TOKENS)
    receiver = _connector(torch.zeros(SHAPE))
    try:
        source = _source(sender, info.block_checksums, deadline_s=0.5,
                         address=f"127.0.0.1:{listener.port}")
        started = time.monotonic()
        with pytest.raises(KVTransferTimeout):
            receiver.load(source, 0, [1, 2])
        assert time.monotonic() - started < 5.0
    finally:
        receiver.close()
        loop = ucx_blocks._EventLoop.get()
        loop.call_soon_threadsafe(release.set)
        loop.call_soon_threadsafe(listener.close)


@needs_ucxx
@pytest.mark.parametrize("staged", [False, True])
def test_a_sender_that_stalls_mid_payload_is_cut_at_the_deadline(sender: KVConnector,
                                                                 staged: bool) -> None:
    """Admitted, then no byte of the payload: the posted receives are cancelled at the
    deadline and nothing lands in the receiver's cache (direct pieces or staged)."""
    import msgspec
    import numpy as np

    release = asyncio.Event()

    async def stalling(ep: Any) -> None:
        hello = np.empty(ucx_blocks._HELLO.size, dtype=np.uint8)
        await ep.recv(hello)
        body = np.empty(ucx_blocks._HELLO.unpack(hello.tobytes())[2], dtype=np.uint8)
        await ep.recv(body)
        pull = msgspec.msgpack.decode(body.tobytes(), type=ucx_blocks.UcxPull)
        listing = msgspec.msgpack.encode(ucx_blocks.UcxPlan(pull.dst_runs, staged))
        await ep.send(ucx_blocks._frame(ucx_blocks._REPLY.pack(b"PDUR", ucx_blocks.OK,
                                                               len(listing))))
        await ep.send(ucx_blocks._frame(listing))
        await release.wait()
        ep.abort()

    async def listen() -> Any:
        from pdmesh.kvstore.transfer.backends.ucx import ucxx_runtime

        return ucxx_runtime().create_listener(stalling, port=0)

    listener = ucx_blocks._EventLoop.run(listen()).result()
    info = sender.export("req", EXPORTED, TOKENS)
    receiver = _connector(torch.zeros(SHAPE))
    try:
        source = _source(sender, info.block_checksums, deadline_s=0.5,
                         address=f"127.0.0.1:{listener.port}")
        started = time.monotonic()
        with pytest.raises(KVTransferTimeout):
            receiver.load(source, 0, [1, 2, 3, 7])
        assert time.monotonic() - started < 5.0
        assert not receiver.cache.any()
        assert ucx_blocks.STAGING.in_use == 0  # dropped, not kept for reuse
    finally:
        receiver.close()
        loop = ucx_blocks._EventLoop.get()
        loop.call_soon_threadsafe(release.set)
        loop.call_soon_threadsafe(listener.close)


@needs_ucxx
def test_a_closed_sender_is_unavailable(sender: KVConnector) -> None:
    info = sender.export("req", EXPORTED, TOKENS)
    source = _source(sender, info.block_checksums, deadline_s=1.0)
    sender.close()
    receiver = _connector(torch.zeros(SHAPE))
    try:
        started = time.monotonic()
        with pytest.raises((KVSenderUnavailable, KVTransferTimeout)):  # the recompute case
            receiver.load(source, 0, [1, 2])
        assert time.monotonic() - started < 5.0
    finally:
        receiver.close()


@needs_ucxx
def test_the_ucx_plane_answers_with_the_listener_and_a_signed_grant() -> None:
    from pdmesh.kvstore.transfer.lease import Grant
    from pdmesh.kvstore.transfer.ucx_plane import UcxPlane

    key = grant_mac.new_key()
    exports = Exports()
    exports.add("t1", (4, 5))
    plane = UcxPlane(CoreCache("", 40, "", key, ucx_server="127.0.0.1:9"), exports)
    grant = Grant(transfer_id="t1", request_id="req", backend="ucxx", token="tok", header=b"")
    params = asyncio.run(plane.prepare(grant))
    assert params["address"] == "127.0.0.1:9"
    assert grant_mac.verify(key, "req", "t1", "tok", params["mac"])


@needs_ucxx
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("first, count", [(0, len(EXPORTED)), (6, 8)])
def test_device_caches_move_over_ucx_without_host_copies(first: int, count: int) -> None:
    """Device to device, never through host memory and never staged (no device memory
    beyond the caches): a fragmented pull and a run of blocks, each straight from cache to
    cache."""
    gen = torch.Generator().manual_seed(4)
    sender = _connector(torch.randn(SHAPE, generator=gen).to("cuda"))
    receiver = _connector(torch.zeros(SHAPE, device="cuda"))
    try:
        info = sender.export("req", EXPORTED, TOKENS)
        dst_ids = list(range(10, 10 + count))
        src_ids = EXPORTED[first:first + count]
        assert ucx_blocks.plan(src_ids, [count]).staged == (first == 0)  # between hosts
        receiver.load(_source(sender, info.block_checksums), first, dst_ids)
        _check(sender.cache, src_ids, receiver.cache, dst_ids)
    finally:
        receiver.close()
        sender.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_the_loop_thread_runs_with_the_caches_device_current() -> None:
    """UCX moves device buffers with the context current on the thread that progresses it: a
    core on cuda:1 must not have its transfers run (or a context made) on device 0."""
    loop = asyncio.new_event_loop()
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    cache = torch.zeros(1, device=device)
    thread = threading.Thread(target=ucx_blocks._run_loop, args=(loop, cache), daemon=True)
    thread.start()

    async def current() -> int:
        return torch.cuda.current_device()

    try:
        assert asyncio.run_coroutine_threadsafe(current(), loop).result(timeout=30) == \
            device.index
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()
