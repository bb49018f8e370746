"""UCX block transport run by the engine cores (`ucxx`): from the sender's cache blocks to the
receiver's, host or device memory, with no staging copy on either side.

The sender core runs a `UcxBlockServer` (a ucxx listener, started like the TCP `BlockServer`,
its address reported in `CoreInfo`); the receiving core's `pull_blocks` connects, presents the
pull its serving process was granted (signed with `grant_mac`, checked exactly as the TCP block
server checks it: one-time per grant and block, only blocks of a live export) and receives
straight into its own cache blocks. UCX picks the path: shared memory or TCP between host
buffers, CUDA IPC / NVLink or GPUDirect RDMA between device buffers (ucxx registers the cache's
device memory itself).

Wire protocol (version 2; integers little-endian; every message an exact-size tagged send):

    client -> server  "PDUQ" u8 version u32 n, then n <= 1 MiB of msgpack `UcxPull`:
                      request_id, transfer_id, grant, mac, first, count, layout, dtype and
                      `dst_runs`, the lengths of the receiver's runs of consecutive blocks
    server -> client  "PDUR" u8 status u32 m, then m bytes: on status 0 (ok) msgpack
                      `UcxPlan` (piece lengths, staged or not), else the UTF-8 reason
                      (1 = denied, 2 = refused)
    server -> client  on ok, direct: for layer, for K/V, for piece, that piece of the cache;
                      staged: for layer, the pull's blocks of that layer gathered in pull
                      order ([2, count, block]); message i tagged with the endpoint's tag
                      + 1 + i (UCX matches tags, not arrival)
    client -> server  one byte once everything landed (a send may complete before the peer
                      has all fragments; closing earlier could reset the connection under them)

A piece is a maximal range of the pull whose source and destination blocks both run
consecutively: the sender cuts its runs at the receiver's run boundaries, so each piece is one
contiguous slice `cache[layer, kv, start:start + n]` on both sides, sent with no copy. A
fragmented pull is many small pieces, and every message has a fixed cost (a shuffled 64-block
pull of the dev box's model is 3,840 pieces of 12 KiB: 210 ms over UCX on TCP, slower than the
staged path it replaced); from `STAGE_MIN_PIECES` pieces per (layer, K/V) on, the sender
gathers each layer's blocks into one buffer (`index_select`) and the receiver scatters them
from one (`index_copy_`) once all landed: one message per layer, for a copy on each side (into
buffers kept between pulls: `staging_buffers.py`). Only between host caches: on a GPU the
staging would take device memory beyond the KV cache's budget, and device-to-device messages
(NVLink, GPUDirect) cost far less each. Direct pieces
are posted a batch at a time straight on ucxx's endpoint (`_post`): its `send`/`recv`
coroutines cost a task and a SHA-1 tag hash per message, more than the bytes of a 12 KiB
piece (a 64-block pull: 480 ms that way, 190 ms posted directly).
The client's every step is bounded by the pull's deadline; on any failure it aborts the
endpoint (UCX cancels the posted receives) and waits for each receive to settle before it
raises, so nothing writes into the cache after `pull_blocks` returns.

ucxx's asynchronous API runs on one event loop: each process that uses this module gets one
daemon thread running it (`_EventLoop`), shared by its listener and its pulls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import struct
import threading
from collections.abc import Coroutine, Sequence
from typing import Annotated, Any, TypeVar

import msgspec
import numpy as np
import torch

from pdmesh.kvstore.connector.blocks import (
    block_nbytes,
    dtype_name,
    layout_mismatch,
    on_device_of,
    runs,
)
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.exports import ExportRegistry
from pdmesh.kvstore.connector.grant_ledger import GrantLedger, GrantRefused, signed
from pdmesh.kvstore.connector.staging_buffers import StagingBuffers
from pdmesh.kvstore.transfer.backends.availability import ucxx_unavailable_reason
from pdmesh.kvstore.transfer.backends.base import format_host
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import (
    KVSenderUnavailable,
    KVTransferDenied,
    KVTransferError,
    KVTransferTimeout,
    KVWireError,
)

logger = logging.getLogger(__name__)

VERSION = 2
MAX_REQUEST_BYTES = 1 << 20
MAX_REPLY_BYTES = 1 << 20
MAX_PULLS = 32            # pulls a server serves at once; the rest wait their turn
IN_FLIGHT = 1024          # piece messages posted at once per pull
STAGE_MIN_PIECES = 4      # pieces per (layer, K/V) from which a pull is staged, not direct
STAGING = StagingBuffers(256 << 20)  # the process's staging buffers, sender and receiver
_TAG_MASK = (1 << 64) - 1
CLOSE_GRACE_S = 5.0
CONNECT_TIMEOUT_S = 5.0   # ucxx's own bound on exchanging peer information
OK, DENIED, REFUSED = 0, 1, 2
_HELLO = struct.Struct("<4sBI")
_REPLY = struct.Struct("<4sBI")
_Text = Annotated[str, msgspec.Meta(max_length=512)]
_T = TypeVar("_T")

unavailable_reason = ucxx_unavailable_reason


class UcxPull(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: _Text
    transfer_id: _Text
    grant: _Text
    mac: _Text
    first: Annotated[int, msgspec.Meta(ge=0)]
    count: Annotated[int, msgspec.Meta(ge=1)]
    layout: tuple[int, int, int, int]  # layers, block_size, kv_heads, head_dim
    dtype: _Text
    dst_runs: list[Annotated[int, msgspec.Meta(ge=1)]]
    stage: bool  # the receiver may stage (its cache is in host memory)


class UcxPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The server's answer to an admitted pull: how its blocks come."""

    pieces: list[int]  # lengths, cutting the pull at both sides' run boundaries
    staged: bool  # one gathered message per layer instead of the pieces themselves


def plan(src_ids: Sequence[int], dst_runs: Sequence[int], *, stage: bool = True) -> UcxPlan:
    """Direct pieces where they are few; staged where the per-message cost would dominate
    and both sides may stage (`stage`: both caches in host memory)."""
    pieces = merge_cuts(run_lengths(src_ids), dst_runs)
    return UcxPlan(pieces, stage and len(pieces) >= STAGE_MIN_PIECES)


_DECODER = msgspec.msgpack.Decoder(UcxPull)
_PLAN = msgspec.msgpack.Decoder(UcxPlan)


class _Refusal(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class _EventLoop:
    """The process's ucxx event loop on a daemon thread, started on first use."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def get(cls, cache: torch.Tensor | None = None) -> asyncio.AbstractEventLoop:
        """The loop; the first call starts its thread with `cache`'s device current there (a
        core process runs on one device)."""
        with cls._lock:
            if cls._loop is None:
                from pdmesh.kvstore.transfer.backends.ucx import ucxx_runtime

                ucxx_runtime()  # initialise UCX before the loop's first endpoint
                loop = asyncio.new_event_loop()
                threading.Thread(target=_run_loop, args=(loop, cache), name="kv-ucx-loop",
                                 daemon=True).start()
                cls._loop = loop
            return cls._loop

    @classmethod
    def run(cls, coro: Coroutine[Any, Any, _T],
            cache: torch.Tensor | None = None) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coro, cls.get(cache))


def _run_loop(loop: asyncio.AbstractEventLoop, cache: torch.Tensor | None) -> None:
    """The loop thread. UCX moves device buffers (cuda_copy, cuda_ipc) with the CUDA context
    current on the thread that progresses it, and a new thread has none: the cache's device
    is made current here, as on every other thread of the core that touches the cache, so no
    context is created on device 0 or missing altogether."""
    with on_device_of(cache) if cache is not None else contextlib.nullcontext():
        loop.run_forever()


def run_lengths(ids: Sequence[int]) -> list[int]:
    """Lengths of the maximal runs of consecutive ids in `ids`."""
    return [n for _, _, n in runs(ids, ids)]


def merge_cuts(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """Piece lengths cutting [0, sum) at every boundary of both run-length lists."""
    bounds = sorted(set(itertools.accumulate(a)) | set(itertools.accumulate(b)))
    return [end - start for start, end in zip([0, *bounds[:-1]], bounds, strict=True)]


def _buffers(cache: torch.Tensor, ids: Sequence[int], pieces: Sequence[int]) -> list[Any]:
    """The pull's pieces of `cache` in wire order (for layer, for K/V, for piece), each a
    contiguous byte buffer sharing the cache's memory: numpy on the host, a tensor on a GPU."""
    starts = [ids[offset] for offset in itertools.accumulate([0, *pieces[:-1]])]
    out: list[Any] = []
    if cache.device.type == "cpu":
        data = cache.view(torch.uint8).numpy().reshape(*cache.shape[:3], -1)
        for layer in range(cache.shape[0]):
            for kv in range(2):
                out += [data[layer, kv, s:s + n].reshape(-1) for s, n in zip(starts, pieces,
                                                                            strict=True)]
        return out
    for layer in range(cache.shape[0]):
        for kv in range(2):
            out += [cache[layer, kv, s:s + n].reshape(-1).view(torch.uint8)
                    for s, n in zip(starts, pieces, strict=True)]
    return out


def staged_shape(cache: torch.Tensor, count: int) -> tuple[int, ...]:
    """A staged pull's payload of `count` blocks: `[layers, 2, count, ...]`."""
    return (cache.shape[0], 2, count, *cache.shape[3:])


def gathered(cache: torch.Tensor, ids: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """The blocks `ids` of every layer, in that order, into `out` (`staged_shape`): a staged
    pull's payload (host caches only)."""
    index = torch.tensor(list(ids), dtype=torch.long)
    return torch.index_select(cache, 2, index, out=out)


def _bytes(t: torch.Tensor) -> Any:
    """A contiguous host tensor's bytes, as ucxx sends or receives them."""
    return t.reshape(-1).view(torch.uint8).numpy()


class UcxBlockServer:
    """Runs in the sender engine core: a ucxx listener on the process's ucxx loop."""

    def __init__(self, cache: torch.Tensor, exports: ExportRegistry,
                 config: KVConnectorConfig, ledger: GrantLedger | None = None) -> None:
        """`ledger`: the grants served so far, shared with the core's other block servers."""
        if not cache.is_contiguous():
            raise ValueError("the UCX block server needs a contiguous KV cache")
        self._cache, self._config = cache, config
        self._ledger = ledger or GrantLedger(exports)
        self._listener: Any = None
        self._endpoints: set[Any] = set()
        self._idle: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._closed = False

    def start(self) -> str:
        """Listen on a port UCX picks; the address peers dial. ucxx binds every interface (it
        takes no address): what keeps strangers out is the signed grant, checked before any
        byte of KV is sent, and UCX carries no TLS, so `--tls` rules ucxx out."""
        port = _EventLoop.run(self._listen(), self._cache).result()
        host = self._config.tcp_advertise_host or self._config.tcp_host
        return f"{format_host(host.strip('[]'))}:{port}"

    async def _listen(self) -> int:
        from pdmesh.kvstore.transfer.backends.ucx import ucxx_runtime

        self._idle, self._slots = asyncio.Event(), asyncio.Semaphore(MAX_PULLS)
        self._idle.set()
        self._listener = ucxx_runtime().create_listener(self._serve, port=0)
        return int(self._listener.port)

    def close(self) -> None:
        if self._listener is None or self._closed:
            return
        self._closed = True
        try:
            _EventLoop.run(self._close()).result(timeout=CLOSE_GRACE_S + 1)
        except (TimeoutError, concurrent.futures.TimeoutError):
            logger.warning("the UCX block server's pulls did not stop in %.0f s", CLOSE_GRACE_S)

    async def _close(self) -> None:
        self._listener.close()
        for ep in list(self._endpoints):
            ep.abort()
        assert self._idle is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), CLOSE_GRACE_S)

    async def _serve(self, ep: Any) -> None:
        assert self._idle is not None and self._slots is not None
        if self._closed:
            ep.abort()
            return
        self._endpoints.add(ep)
        self._idle.clear()
        timeout = self._config.io_timeout_s
        try:
            async with self._slots:
                await self._answer(ep, timeout)
        except _Refusal as exc:
            logger.debug("UCX block pull refused: %s", exc)
            reason = str(exc).encode()[:1024]
            with contextlib.suppress(Exception):
                await _bounded(ep.send(_frame(_REPLY.pack(b"PDUR", exc.status, len(reason)))),
                               timeout)
                await _bounded(ep.send(_frame(reason)), timeout)
                await _bounded(ep.recv(np.empty(1, dtype=np.uint8)), timeout)
        except TimeoutError:
            logger.debug("UCX block send timed out")
        except Exception as exc:  # ucxx raises its own error types when a peer vanishes
            logger.debug("UCX block send ended early: %r", exc)
        finally:
            self._endpoints.discard(ep)
            await _close(ep)
            if not self._endpoints:
                self._idle.set()

    async def _answer(self, ep: Any, timeout: float) -> None:
        hello = np.empty(_HELLO.size, dtype=np.uint8)
        await _bounded(ep.recv(hello), timeout)
        magic, version, length = _HELLO.unpack(hello.tobytes())
        if magic != b"PDUQ":
            raise _Refusal(REFUSED, "not a UCX block pull request")
        if version != VERSION:
            raise _Refusal(REFUSED, f"protocol version {version} (this server speaks {VERSION})")
        if not 0 < length <= MAX_REQUEST_BYTES:
            raise _Refusal(REFUSED, f"a {length}-byte request (at most {MAX_REQUEST_BYTES})")
        body = np.empty(length, dtype=np.uint8)
        await _bounded(ep.recv(body), timeout)
        try:
            req = _DECODER.decode(body.tobytes())
        except msgspec.MsgspecError as exc:
            raise _Refusal(REFUSED, f"malformed request: {exc}") from None
        ids = self._admit(req)
        how = plan(ids, req.dst_runs, stage=req.stage and not self._cache.is_cuda)
        listing = msgspec.msgpack.encode(how)
        await _bounded(ep.send(_frame(_REPLY.pack(b"PDUR", OK, len(listing)))), timeout)
        await _bounded(ep.send(_frame(listing)), timeout)
        staged = None
        if how.staged:
            staged = STAGING.take(staged_shape(self._cache, len(ids)), self._cache.dtype,
                                  self._cache.device)
        try:
            # A device cache's blocks are complete already: an export's checksums are read on
            # the model's stream and answered to the host before any grant names its blocks,
            # so no device-wide synchronize here (it would stall every UCX pull and listener
            # on this loop thread behind the engine's queued steps); a receiver checks every
            # block it landed against those checksums anyway.
            if staged is not None:
                gathered(self._cache, ids, staged)
                buffers = [_bytes(staged[layer]) for layer in range(staged.shape[0])]
            else:
                buffers = _buffers(self._cache, ids, how.pieces)
            for start in range(0, len(buffers), IN_FLIGHT):
                sends = _post(ep, buffers[start:start + IN_FLIGHT], start, send=True)
                await _bounded(asyncio.gather(*(request.wait() for request in sends)),
                               timeout)
        except BaseException:
            if staged is not None:  # a send may still read it
                STAGING.drop(staged)
            raise
        if staged is not None:  # every send completed: nothing reads it any more
            STAGING.give_back(staged)
        await _bounded(ep.recv(np.empty(1, dtype=np.uint8)), timeout)

    def _admit(self, req: UcxPull) -> tuple[int, ...]:
        if not signed(self._config.grant_secret, req.request_id, req.transfer_id, req.grant,
                      req.mac):
            raise _Refusal(DENIED, "the pull's grant signature is not valid")
        if (mismatch := layout_mismatch(self._cache, req.layout, req.dtype)) is not None:
            raise _Refusal(REFUSED, mismatch)
        if sum(req.dst_runs) != req.count:
            raise _Refusal(REFUSED, f"destination runs of {sum(req.dst_runs)} blocks for "
                                    f"{req.count}")
        try:
            return self._ledger.admit(req.request_id, req.grant, req.first, req.count)
        except GrantRefused as exc:
            raise _Refusal(DENIED, str(exc)) from None


def pull_blocks(address: str, *, request_id: str, transfer_id: str, grant: str, mac: str,
                first_block: int, dst: torch.Tensor, dst_ids: list[int],
                config: KVConnectorConfig, deadline: Deadline) -> int:
    """Receive export blocks [first_block, first_block + len(dst_ids)) of `request_id` from the
    UcxBlockServer at `address` straight into dst[:, :, dst_ids]; returns bytes received.

    Raises KVTransferTimeout past the deadline, KVTransferDenied when the server denies the
    pull, KVSenderUnavailable when it cannot be reached or the endpoint fails, KVWireError on a
    protocol violation or a layout the server refuses. Nothing writes into `dst` after it
    returns or raises."""
    if not dst.is_contiguous():
        raise ValueError("pull_blocks needs a contiguous destination cache")
    if first_block < 0 or any(not 0 <= d < dst.shape[2] for d in dst_ids):
        raise ValueError(f"block ids out of range: first {first_block}, destinations {dst_ids}")
    host, _, port = address.rpartition(":")
    ids = {"transfer_id": transfer_id, "request_id": request_id}
    if not host or not port.isdigit():
        raise KVWireError(f"not a UCX block server address: {address!r}", **ids)
    if not dst_ids:
        return 0
    request = UcxPull(request_id, transfer_id, grant, mac, first_block, len(dst_ids),
                      (dst.shape[0], *dst.shape[3:]), dtype_name(dst.dtype),
                      run_lengths(dst_ids), stage=not dst.is_cuda)
    where = f"UCX block pull from {address}"
    if dst.is_cuda:
        # UCX writes the blocks through no torch stream, so this thread's stream (the pull's
        # receiving stream: it waits for the steps the engine had queued when the pull
        # began, `blocks.receiving_stream`) is waited for here, on the host, before any
        # receive is posted: a block freed by a request whose last step is in flight is
        # written by that step first.
        torch.cuda.current_stream(dst.device).synchronize()
    try:
        return _EventLoop.run(_pull(host.strip("[]"), int(port), request, dst, dst_ids,
                                    deadline), dst).result()
    except KVTransferError as exc:
        if not exc.transfer_id:
            raise type(exc)(str(exc), **ids) from exc
        raise
    except TimeoutError:
        raise KVTransferTimeout(f"{where} timed out", **ids) from None
    except Exception as exc:  # ucxx's own errors: the endpoint failed or closed
        raise KVSenderUnavailable(f"{where} failed: {exc!r}", **ids) from exc


async def _pull(host: str, port: int, request: UcxPull, dst: torch.Tensor, dst_ids: list[int],
                deadline: Deadline) -> int:
    from pdmesh.kvstore.transfer.backends.ucx import ucxx_runtime

    connect_s = min(CONNECT_TIMEOUT_S, deadline.remaining())
    ep = await _bounded(ucxx_runtime().create_endpoint(host, port, connect_timeout=connect_s),
                        deadline.remaining())
    receives: list[asyncio.Future[Any]] = []
    staging: torch.Tensor | None = None
    try:
        body = msgspec.msgpack.encode(request)
        await _bounded(ep.send(_frame(_HELLO.pack(b"PDUQ", VERSION, len(body)))),
                       deadline.remaining())
        await _bounded(ep.send(_frame(body)), deadline.remaining())
        reply = np.empty(_REPLY.size, dtype=np.uint8)
        await _bounded(ep.recv(reply), deadline.remaining())
        magic, status, length = _REPLY.unpack(reply.tobytes())
        if magic != b"PDUR" or length > MAX_REPLY_BYTES:
            raise KVWireError("the UCX block server's reply is not a block pull reply")
        text = np.empty(length, dtype=np.uint8)
        if length:
            await _bounded(ep.recv(text), deadline.remaining())
        if status != OK:
            await _bounded(ep.send(_frame(b"\x01")), deadline.remaining())
            reason = text.tobytes().decode(errors="replace")
            if status == DENIED:
                raise KVTransferDenied(f"the UCX block server denied the pull: {reason}")
            raise KVWireError(f"the UCX block server refused the pull: {reason}")
        how = _checked_plan(text.tobytes(), request)
        if how.staged:  # landed here first, scattered into the cache once all of it came
            staging = STAGING.take(staged_shape(dst, len(dst_ids)), dst.dtype, dst.device)
            buffers = [_bytes(staging[layer]) for layer in range(dst.shape[0])]
        else:
            buffers = _buffers(dst, dst_ids, how.pieces)
        for start in range(0, len(buffers), IN_FLIGHT):
            receives = [asyncio.ensure_future(request.wait()) for request in
                        _post(ep, buffers[start:start + IN_FLIGHT], start, send=False)]
            done, pending = await asyncio.wait(receives, timeout=deadline.remaining(),
                                               return_when=asyncio.FIRST_EXCEPTION)
            if pending:
                failed = next((t for t in done if t.exception() is not None), None)
                if failed is not None:
                    failed.result()
                raise TimeoutError
            for task in done:
                task.result()
        receives = []
        if staging is not None:
            scatter(dst, dst_ids, staging)
            STAGING.give_back(staging)  # every receive completed: nothing writes it any more
        await _bounded(ep.send(_frame(b"\x01")), deadline.remaining())
    except BaseException:
        ep.abort()  # UCX cancels the posted receives: each settles before we hand `dst` back
        if staging is not None:  # a receive that did not settle may still write it
            STAGING.drop(staging)
        if receives:
            _, pending = await asyncio.wait(receives, timeout=CLOSE_GRACE_S)
            if pending:
                logger.warning("%d UCX receives were not cancelled in %.0f s", len(pending),
                               CLOSE_GRACE_S)
            for task in receives:
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: no "never retrieved" warning
        raise
    await _close(ep)
    return len(dst_ids) * block_nbytes(dst)


def _post(ep: Any, buffers: list[Any], first: int, *, send: bool) -> list[Any]:
    """Post a tagged send (or receive) of each buffer on the endpoint, message `first + i`
    tagged with the endpoint's own tag + 1 + first + i; the requests, to `wait()` on.

    Uses ucxx's endpoint internals (`Endpoint._ep`, `Endpoint._tags`, ucxx 0.52 as pinned by
    scripts/setup.sh): the public `send`/`recv` would cost a coroutine and a SHA-1 per piece.
    The endpoint's tag is random per connection, so two pulls on one worker never match."""
    from ucxx._lib.arr import Array
    from ucxx.types import Tag

    base = ep._tags["msg_send" if send else "msg_recv"]
    post = ep._ep.tag_send if send else ep._ep.tag_recv
    return [post(Array(buf), Tag((base + 1 + first + i) & _TAG_MASK))
            for i, buf in enumerate(buffers)]


def scatter(dst: torch.Tensor, dst_ids: Sequence[int], staging: torch.Tensor) -> None:
    """A staged pull's payload into its destination blocks (host caches only)."""
    dst.index_copy_(2, torch.tensor(list(dst_ids), dtype=torch.long), staging)


def _checked_plan(listing: bytes, request: UcxPull) -> UcxPlan:
    """The server's plan, refused unless its pieces cover the pull and cut it at every
    boundary of our destination runs (else a piece would straddle two of our runs)."""
    try:
        how = _PLAN.decode(listing)
    except msgspec.MsgspecError:
        raise KVWireError("the UCX block server's piece list is malformed") from None
    pieces = how.pieces
    if how.staged and not request.stage:
        raise KVWireError("the UCX block server stages a pull this receiver cannot stage")
    if (any(n < 1 for n in pieces) or sum(pieces) != request.count
            or not set(itertools.accumulate(request.dst_runs))
            <= set(itertools.accumulate(pieces))):
        raise KVWireError("the UCX block server's pieces do not fit the pull")
    return how


async def _bounded(awaitable: Any, timeout: float) -> Any:
    """`awaitable` within `timeout` seconds (TimeoutError past it, also when none is left)."""
    if timeout <= 0:
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        elif isinstance(awaitable, asyncio.Future):
            awaitable.cancel()
        raise TimeoutError
    return await asyncio.wait_for(awaitable, timeout)


def _frame(data: bytes) -> np.ndarray:
    return np.frombuffer(bytearray(data), dtype=np.uint8)


async def _close(ep: Any) -> None:
    try:
        await ep.close()
    except Exception as exc:
        logger.debug("ucxx endpoint close: %r", exc)
