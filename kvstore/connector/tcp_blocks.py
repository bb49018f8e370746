"""TCP block transport run by the engine cores: from the sender's cache blocks to the receiver's.

The sender core's `BlockServer` streams a granted export straight out of its cache tensor and
`pull_blocks` in the receiver core receives straight into its own: no whole-payload buffer on
either side. A pull may use several connections, each carrying a contiguous sub-range of the
blocks, so the kernel copies of big transfers run in parallel (blocking sockets, GIL released).

Wire protocol (version 1; integers little-endian):

    client -> server  "PDBQ" u8 version u32 n, then n <= 4 KiB of msgpack `PullRequest`:
                      request_id, transfer_id, grant, mac, first, count,
                      layout (layers, block_size, kv_heads, head_dim), dtype; for torch_dist
                      also via, device, the receiver's GPU and the pair's kept group
                      (`dist_blocks.py`; fields left at their defaults are not sent)
    server -> client  "PDBR" u8 status u16 m u64 payload_bytes, then m bytes of UTF-8 reason;
                      status 0 = ok, 1 = denied (signature, unknown export, range, replay),
                      2 = refused (malformed request, version, layout mismatch)
    server -> client  on ok, payload_bytes of KV: for layer, for K/V, the requested blocks in
                      order, each block_size * kv_heads * head_dim elements; then it closes.

Each side cuts that one byte stream by its own runs of consecutive block ids (`blocks.runs`):
the sender `sendall`s each run of its cache, the receiver `recv_into`s each run of its own; a
device cache goes through a bounded pinned host buffer, a run (or a piece of one) at a time.

The server admits a request only with a valid `grant_mac` signature (the control plane granted
it), then a matching layout and a range inside the export. Several connections present the same
grant, so one-time-ness is per block: under one grant each block of an export is served at most
once, and a replayed or overlapping range is denied. With TLS configured every connection is
TLS (`backends/tls.py`, mutual with a CA): the server refuses plaintext, the client never falls
back to it. Every blocking step is bounded by `io_timeout_s` and, on the client, the deadline.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Annotated

import msgspec
import torch

from pdmesh.grpc_common import TLSConfig
from pdmesh.kvstore.connector import dist_blocks
from pdmesh.kvstore.connector.blocks import (
    block_nbytes,
    byte_view,
    device_uuid,
    dtype_name,
    layout_mismatch,
    on_device_of,
    runs,
    sending_stream,
)
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.dist_groups import PairGroups
from pdmesh.kvstore.connector.exports import ExportRegistry
from pdmesh.kvstore.connector.grant_ledger import GrantLedger, GrantRefused, signed
from pdmesh.kvstore.connector.rank_caches import RankCaches
from pdmesh.kvstore.transfer.backends.base import format_host
from pdmesh.kvstore.transfer.backends.tls import client_context, server_context
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import (
    KVBackendUnavailable,
    KVSenderUnavailable,
    KVTransferDenied,
    KVTransferError,
    KVTransferTimeout,
    KVWireError,
)

logger = logging.getLogger(__name__)

VERSION = 1
MAX_REQUEST_BYTES = 4096
MAX_CONNECTIONS = 32  # concurrent connections a server serves; more are closed at once
MIN_BLOCKS_PER_CONNECTION = 8  # below this a connection's set-up costs more than it brings
IOV_BATCH = 512  # buffers per sendmsg/recvmsg_into (Linux allows 1024)
STAGE_BYTES = 8 << 20  # pinned host buffer per connection for a device cache
CLOSE_GRACE_S = 5.0
OK, DENIED, REFUSED = 0, 1, 2
_HELLO = struct.Struct("<4sBI")
_REPLY = struct.Struct("<4sBHQ")
_Text = Annotated[str, msgspec.Meta(max_length=512)]


class PullRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    request_id: _Text
    transfer_id: _Text
    grant: _Text
    mac: _Text
    first: Annotated[int, msgspec.Meta(ge=0)]
    count: Annotated[int, msgspec.Meta(ge=1)]
    layout: tuple[int, int, int, int]  # layers, block_size, kv_heads, head_dim
    dtype: _Text
    via: _Text = "tcp"      # "torch_dist": the bytes go over a process group (dist_blocks.py)
    device: _Text = "cpu"   # the receiver's cache device type (NCCL needs both on GPUs)
    gpu: _Text = ""         # torch_dist: the receiver's GPU (UUID): NCCL needs two GPUs
    group: _Text = ""       # torch_dist: the pair's kept group, by the sender's id (dist_groups)
    keep: bool = False      # torch_dist: the receiver keeps the group for the next pull


_DECODER = msgspec.msgpack.Decoder(PullRequest)


class _Refusal(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class BlockServer:
    """Runs in the sender engine core: a listener thread + one thread per connection."""

    def __init__(self, cache: torch.Tensor, exports: ExportRegistry,
                 config: KVConnectorConfig, ledger: GrantLedger | None = None,
                 ranks: RankCaches | None = None) -> None:
        """`ledger`: the grants served so far, shared with the core's other block servers;
        `ranks`: a tensor-parallel core's every rank's cache (`cache` is the first), whose
        blocks go out canonical (every KV head once), gathered piece by piece."""
        if not cache.is_contiguous():
            raise ValueError("the block server needs a contiguous KV cache")
        self._cache, self._config = cache, config
        self._ranks = ranks if ranks is not None and ranks.world > 1 else None
        self._ledger = ledger or GrantLedger(exports)
        self._tls = server_context(_tls_config(config))
        if config.tls_enabled and self._tls is None:  # a CA alone: never serve plaintext
            raise ValueError("the block server's TLS needs a certificate and a key")
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._conns: dict[threading.Thread, socket.socket] = {}
        self._groups = PairGroups()  # torch_dist: a group per receiving core, kept

    def start(self) -> str:
        host = self._config.tcp_host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=128)
        port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-blocks-accept",
                                          daemon=True)
        self._acceptor.start()
        return f"{format_host(self._config.tcp_advertise_host or host)}:{port}"

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns.items())
        if self._listener is not None:
            _shutdown(self._listener)  # wakes the blocked accept()
            self._listener.close()
        for _, conn in conns:
            _shutdown(conn)
        threads = [t for t, _ in conns] + ([self._acceptor] if self._acceptor else [])
        for thread in threads:
            thread.join(timeout=CLOSE_GRACE_S)
            if thread.is_alive():
                logger.warning("KV block server thread %s did not stop", thread.name)
        self._groups.close()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            thread = threading.Thread(target=self._serve_on_device, args=(conn,),
                                      name="kv-blocks-send",
                                      daemon=True)
            with self._lock:  # started under the lock, so close() joins only started threads
                admitted = not self._closed and len(self._conns) < MAX_CONNECTIONS
                if admitted:
                    self._conns[thread] = conn
                    thread.start()
            if not admitted:
                logger.debug("KV block server refused %s: closed or %d connections", peer,
                             MAX_CONNECTIONS)
                conn.close()

    def _serve_on_device(self, conn: socket.socket) -> None:
        with on_device_of(self._cache), sending_stream(self._cache):
            self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        me = threading.current_thread()
        try:
            conn.settimeout(self._config.io_timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                # Handshake here, not in the accept loop, so a silent client stalls only itself.
                conn = self._tls.wrap_socket(conn, server_side=True,
                                             do_handshake_on_connect=False)
                with self._lock:  # close() must shut down the socket that is now in use
                    self._conns[me] = conn
                    if self._closed:
                        return
                conn.do_handshake()
            req = _read_request(conn)
            if req.via not in ("tcp", "torch_dist") or (req.via == "torch_dist"
                                                       and not dist_blocks.available()):
                raise _Refusal(REFUSED, f"this block server does not send over {req.via!r}")
            if req.via == "torch_dist" and self._ranks is not None:
                raise _Refusal(REFUSED, "a tensor-parallel core sends over tcp, not torch_dist")
            ids = self._admit(req)
            if self._ranks is not None:  # canonical blocks, gathered from every rank
                conn.sendall(_REPLY.pack(b"PDBR", OK, 0, len(ids) * self._ranks.block_nbytes))
                _move_ranks(self._ranks, ids, conn.sendall, into=False)
                return
            payload = len(ids) * block_nbytes(self._cache)
            if req.via == "torch_dist":
                def answer(rendezvous: str) -> None:  # in the reason field
                    text = rendezvous.encode()
                    conn.sendall(_REPLY.pack(b"PDBR", OK, len(text), payload) + text)

                dist_blocks.serve_pull(conn, answer, self._groups, req.group, req.keep,
                                       self._cache, ids, req.device, req.gpu, self._config)
                return
            conn.sendall(_REPLY.pack(b"PDBR", OK, 0, payload))
            if self._cache.device.type == "cpu" and not isinstance(conn, ssl.SSLSocket):
                _send_vectored(conn, _views(self._cache, ids))
            else:
                _move(self._cache, ids, conn.sendall, into=False)
        except _Refusal as exc:
            logger.debug("KV block pull refused: %s", exc)
            reason = str(exc).encode()[:1024]
            with contextlib.suppress(OSError):
                conn.sendall(_REPLY.pack(b"PDBR", exc.status, len(reason), 0) + reason)
        except OSError as exc:  # the client went away, timed out, failed TLS
            logger.debug("KV block send ended early: %s", exc)
        except Exception:
            logger.warning("KV block send failed", exc_info=True)
        finally:
            with self._lock:
                self._conns.pop(me, None)
            conn.close()

    def _admit(self, req: PullRequest) -> tuple[int, ...]:
        if not signed(self._config.grant_secret, req.request_id, req.transfer_id, req.grant,
                      req.mac):
            raise _Refusal(DENIED, "the pull's grant signature is not valid")
        layout = self._ranks.layout if self._ranks is not None else None
        if (mismatch := layout_mismatch(self._cache, req.layout, req.dtype, layout)) is not None:
            raise _Refusal(REFUSED, mismatch)
        try:
            return self._ledger.admit(req.request_id, req.grant, req.first, req.count)
        except GrantRefused as exc:
            raise _Refusal(DENIED, str(exc)) from None


def pull_blocks(address: str, *, request_id: str, transfer_id: str, grant: str, mac: str,
                first_block: int, dst: torch.Tensor, dst_ids: list[int],
                config: KVConnectorConfig, deadline: Deadline, via: str = "tcp",
                ranks: RankCaches | None = None, groups: PairGroups | None = None) -> int:
    """Receive export blocks [first_block, first_block + len(dst_ids)) of `request_id` from the
    BlockServer at `address` straight into dst[:, :, dst_ids]; returns bytes received.
    `ranks`: a tensor-parallel receiver's every rank's cache (`dst` is the first): each
    received piece is split over them (over tcp only). `groups`: the torch_dist groups this
    core keeps, one per sender (None: a group for this pull only).

    Up to `config.tcp_connections` connections (the calling thread's and one thread each for
    the others), each a contiguous sub-range. The first failure shuts every socket down, and
    all threads are joined before this returns or raises: nothing writes into `dst` after it.
    Raises KVTransferTimeout past the deadline, KVTransferDenied when the server denies the
    pull, KVSenderUnavailable when it cannot be reached or the connection drops, KVWireError on
    a protocol violation or a layout the server refuses."""
    if not dst.is_contiguous():
        raise ValueError("pull_blocks needs a contiguous destination cache")
    if first_block < 0 or any(not 0 <= d < dst.shape[2] for d in dst_ids):
        raise ValueError(f"block ids out of range: first {first_block}, destinations {dst_ids}")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise KVWireError(f"not a block server address: {address!r}", transfer_id=transfer_id,
                          request_id=request_id)
    if not dst_ids:
        return 0
    ranks = ranks if ranks is not None and ranks.world > 1 else None
    if ranks is not None and via != "tcp":
        raise KVBackendUnavailable(f"a tensor-parallel engine pulls over tcp, not {via}")
    layout = ranks.layout if ranks is not None else (dst.shape[0], *dst.shape[3:])
    request = PullRequest(request_id, transfer_id, grant, mac, first_block, len(dst_ids),
                          tuple(layout), dtype_name(dst.dtype), via, dst.device.type,
                          gpu=device_uuid(dst.device) if via == "torch_dist" else "")
    pull = _Pull((host.strip("[]"), int(port)), request, dst, dst_ids, config, deadline, ranks,
                 groups)
    per_block = ranks.block_nbytes if ranks is not None else block_nbytes(dst)
    connections = config.tcp_connections if via == "tcp" else 1  # one group per pair
    parts = connection_ranges(len(dst_ids), connections)
    threads = [threading.Thread(target=pull.run_on_device, args=part, name="kv-blocks-recv",
                                daemon=True) for part in parts[1:]]
    done = False
    try:
        for thread in threads:
            thread.start()
        pull.run(*parts[0])
        done = True
    finally:
        if not done:  # interrupted here (a failing thread aborts the pull itself)
            pull.abort()
        for thread in threads:
            if thread.ident is not None:
                thread.join()
    if pull.error is not None:
        raise pull.error
    if pull.nbytes != len(dst_ids) * per_block:  # a thread died of a BaseException
        raise KVWireError(f"a KV block pull ended with {pull.nbytes} bytes of "
                          f"{len(dst_ids) * per_block}", transfer_id=transfer_id,
                          request_id=request_id)
    return pull.nbytes


def connection_ranges(count: int, connections: int) -> list[tuple[int, int]]:
    """`(offset, length)` contiguous sub-ranges, one per connection, each of at least
    MIN_BLOCKS_PER_CONNECTION blocks (a small pull uses one connection)."""
    k = max(1, min(connections, count // MIN_BLOCKS_PER_CONNECTION))
    base, extra = divmod(count, k)
    return [(i * base + min(i, extra), base + (i < extra)) for i in range(k)]


class _Pull:
    """One pull's shared state: its sockets (to abort them), its first error, its byte count."""

    def __init__(self, address: tuple[str, int], request: PullRequest, dst: torch.Tensor,
                 dst_ids: list[int], config: KVConnectorConfig, deadline: Deadline,
                 ranks: RankCaches | None = None, groups: PairGroups | None = None) -> None:
        self.address, self.request, self.dst, self.dst_ids = address, request, dst, dst_ids
        self.ranks, self.groups = ranks, groups
        self.config, self.deadline = config, deadline
        self.tls = client_context(_tls_config(config))
        self.error: KVTransferError | None = None
        self.nbytes = 0
        # A device cache's writes go to the caller's stream (`receiving_stream`) on every
        # thread of the pull (this is built on the caller's).
        self.stream = torch.cuda.current_stream(dst.device) if dst.device.type == "cuda" else None
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._aborted = False

    def abort(self) -> None:
        """Shut every socket down: each thread's next socket step fails and it returns."""
        with self._lock:
            self._aborted = True
            for sock in self._socks:
                _shutdown(sock)

    def run_on_device(self, offset: int, count: int) -> None:
        with on_device_of(self.dst), (torch.cuda.stream(self.stream) if self.stream is not None
                                      else contextlib.nullcontext()):
            self.run(offset, count)

    def run(self, offset: int, count: int) -> None:
        try:
            nbytes = self._receive(offset, count)
            with self._lock:
                self.nbytes += nbytes
        except Exception as exc:
            with self._lock:
                first = self.error is None and not self._aborted  # not an abort's echo
                if first:
                    self.error = self._error(exc)
            if first:
                self.abort()

    def _error(self, exc: Exception) -> KVTransferError:
        if isinstance(exc, KVTransferError):
            return exc
        where = f"KV block pull from {format_host(self.address[0])}:{self.address[1]}"
        ids = {"transfer_id": self.request.transfer_id, "request_id": self.request.request_id}
        if isinstance(exc, TimeoutError):
            return KVTransferTimeout(f"{where} timed out", **ids)
        if isinstance(exc, OSError):
            return KVSenderUnavailable(f"{where} failed: {exc}", **ids)
        return KVWireError(f"{where} failed: {exc!r}", **ids)

    def _timeout(self) -> float:
        remaining = self.deadline.remaining()
        if remaining <= 0:
            raise TimeoutError
        return min(self.config.io_timeout_s, remaining)

    def _receive(self, offset: int, count: int) -> int:
        family, _, _, _, sockaddr = socket.getaddrinfo(*self.address, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        if self.tls is not None:  # wrapped before connect: an abort hits the socket in use
            sock = self.tls.wrap_socket(sock, server_hostname=self.address[0])
        with self._lock:
            if self._aborted:
                sock.close()
                raise ConnectionAbortedError("the pull was aborted")
            self._socks.add(sock)
        key = f"{self.address[0]}:{self.address[1]}"
        held = (self.groups.take(key) if self.request.via == "torch_dist"
                and self.groups is not None else None)  # the group kept for this sender
        try:
            sock.settimeout(self._timeout())
            sock.connect(sockaddr)  # and the TLS handshake
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            dist = ({"group": held.group_id if held is not None else "", "keep": True}
                    if self.request.via == "torch_dist" and self.groups is not None else {})
            body = msgspec.msgpack.encode(msgspec.structs.replace(
                self.request, first=self.request.first + offset, count=count, **dist))
            sock.settimeout(self._timeout())
            sock.sendall(_HELLO.pack(b"PDBQ", VERSION, len(body)) + body)
            magic, status, length, payload = _REPLY.unpack(_recv(sock, _REPLY.size, self._timeout))
            if magic != b"PDBR":
                raise KVWireError("the block server's reply is not a block pull reply")
            reason = _recv(sock, length, self._timeout).decode(errors="replace")
            if status == DENIED:
                raise KVTransferDenied(f"the block server denied the pull: {reason}")
            if status != OK:
                raise KVWireError(f"the block server refused the pull: {reason}")
            if self.request.via == "torch_dist":
                group, held = held, None  # receive_pull gives it back or closes it
                return dist_blocks.receive_pull(
                    sock, self.address[0], reason, payload, group, self.groups, key, self.dst,
                    self.dst_ids[offset:offset + count], self.deadline, self.config)
            per_block = (self.ranks.block_nbytes if self.ranks is not None
                         else block_nbytes(self.dst))
            if payload != count * per_block:
                raise KVWireError(f"the block server sends {payload} bytes for {count} blocks "
                                  f"of {per_block}")
            ids = self.dst_ids[offset:offset + count]
            if self.ranks is not None:
                _move_ranks(self.ranks, ids, lambda view: _recv_into(sock, view, self._timeout),
                            into=True)
            elif self.dst.device.type == "cpu" and not isinstance(sock, ssl.SSLSocket):
                _recv_vectored(sock, _views(self.dst, ids), self._timeout)
            else:
                _move(self.dst, ids, lambda view: _recv_into(sock, view, self._timeout),
                      into=True)
            return payload
        finally:
            if held is not None and self.groups is not None:  # never used: still the pair's
                self.groups.give_back(key, held)  # (a refusal, a timeout before the reply)
            with self._lock:
                self._socks.discard(sock)
            sock.close()


def _move(cache: torch.Tensor, ids: Sequence[int], io: Callable[[memoryview], object], *,
          into: bool) -> None:
    """The wire order: for layer, for K/V, blocks `ids` of `cache`, one `io` call per run of
    consecutive ids; a device cache goes through a pinned host buffer, a piece at a time."""
    stage, limit = _stage(cache, len(ids))
    pieces = [(s + i, min(limit, n - i)) for s, _, n in runs(ids, ids) for i in range(0, n, limit)]
    for layer in range(cache.shape[0]):
        for kv in range(2):
            for s, n in pieces:
                piece = cache[layer, kv, s:s + n]
                host = piece if stage is None else stage[:piece.numel()].view(piece.shape)
                if stage is not None and not into:
                    host.copy_(piece)
                io(memoryview(host.reshape(-1).view(torch.uint8).numpy()).cast("B"))
                if stage is not None and into:
                    piece.copy_(host)


def _move_ranks(ranks: RankCaches, ids: Sequence[int], io: Callable[[memoryview], object],
                *, into: bool) -> None:
    """`_move` for a tensor-parallel core: the same wire order of canonical pieces, each
    gathered from (or split over) the ranks' caches through a host buffer of a few blocks."""
    first = ranks.first
    _, block_size, heads, head_dim = ranks.layout
    per_block = block_size * heads * head_dim
    limit = max(1, STAGE_BYTES // (per_block * first.element_size()))
    stage = torch.empty(min(len(ids), limit) * per_block, dtype=first.dtype,
                        pin_memory=first.device.type == "cuda")
    pieces = [(s + i, min(limit, n - i)) for s, _, n in runs(ids, ids) for i in range(0, n, limit)]
    if into:
        ranks.wait_for_steps()  # a landing block may still be in use by a step in flight
    for layer in range(first.shape[0]):
        for kv in range(2):
            for s, n in pieces:
                host = stage[:n * per_block].view(n, block_size, heads, head_dim)
                if not into:
                    ranks.read_piece(layer, kv, s, host)
                io(memoryview(host.reshape(-1).view(torch.uint8).numpy()).cast("B"))
                if into:
                    ranks.write_piece(layer, kv, s, host)
    if into:
        ranks.wait_for_writes()  # landed before a rank's step reads it


def _views(cache: torch.Tensor, ids: Sequence[int]) -> list[memoryview]:
    """A CPU cache's runs of `ids` in wire order, as byte views (no copy)."""
    data = byte_view(cache)
    pieces = [(s, n) for s, _, n in runs(ids, ids)]
    return [memoryview(data[layer, kv, s:s + n]).cast("B")
            for layer in range(data.shape[0]) for kv in range(2) for s, n in pieces]


def _send_vectored(sock: socket.socket, views: list[memoryview]) -> None:
    """`sendall` of many buffers, up to IOV_BATCH per system call (a shuffled block list is
    thousands of small pieces: one syscall each would cost more than the bytes)."""
    pending = [v for v in views if len(v)]
    while pending:
        batch = pending[:IOV_BATCH]
        pending = _advance(batch, sock.sendmsg(batch)) + pending[len(batch):]


def _recv_vectored(sock: socket.socket, views: list[memoryview],
                   timeout: Callable[[], float]) -> None:
    """Fill many buffers, up to IOV_BATCH per system call; each call bounded by `timeout`."""
    pending = [v for v in views if len(v)]
    total = sum(len(v) for v in pending)
    got_all = 0
    while pending:
        batch = pending[:IOV_BATCH]
        sock.settimeout(timeout())
        got = sock.recvmsg_into(batch)[0]
        if got == 0:
            raise ConnectionError(f"the peer closed the connection after {got_all} of "
                                  f"{total} bytes")
        got_all += got
        pending = _advance(batch, got) + pending[len(batch):]


def _advance(batch: list[memoryview], nbytes: int) -> list[memoryview]:
    """What of `batch` is left after a vectored call moved its first `nbytes`."""
    done = 0
    while done < len(batch) and nbytes >= len(batch[done]):
        nbytes -= len(batch[done])
        done += 1
    rest = batch[done:]
    if rest and nbytes:
        rest[0] = rest[0][nbytes:]
    return rest


def _stage(cache: torch.Tensor, count: int) -> tuple[torch.Tensor | None, int]:
    """A pinned host buffer for a device cache and the blocks it holds (a CPU cache needs none:
    its runs go to and from the socket whole)."""
    if cache.device.type == "cpu":
        return None, max(count, 1)
    per_block = cache[0, 0, 0].numel()
    blocks = min(count, max(1, STAGE_BYTES // (per_block * cache.element_size())))
    return torch.empty(blocks * per_block, dtype=cache.dtype, pin_memory=True), blocks


def _read_request(conn: socket.socket) -> PullRequest:
    magic, version, length = _HELLO.unpack(_recv(conn, _HELLO.size))
    if magic != b"PDBQ":
        raise _Refusal(REFUSED, "not a KV block pull request")
    if version != VERSION:
        raise _Refusal(REFUSED, f"protocol version {version} (this server speaks {VERSION})")
    if length > MAX_REQUEST_BYTES:
        raise _Refusal(REFUSED, f"a {length}-byte request (at most {MAX_REQUEST_BYTES})")
    try:
        return _DECODER.decode(_recv(conn, length))
    except msgspec.MsgspecError as exc:
        raise _Refusal(REFUSED, f"malformed request: {exc}") from None


def _recv(sock: socket.socket, n: int, timeout: Callable[[], float] | None = None) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), timeout)
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview,
               timeout: Callable[[], float] | None = None) -> None:
    """Fill `view`; `timeout` (when given) bounds each step anew (it raises past a deadline)."""
    got = 0
    while got < len(view):
        if timeout is not None:
            sock.settimeout(timeout())
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of "
                                  f"{len(view)} bytes")
        got += n


def _tls_config(config: KVConnectorConfig) -> TLSConfig | None:
    if not config.tls_enabled:
        return None
    return TLSConfig(config.tls_cert or None, config.tls_key or None, config.tls_ca or None)


def _shutdown(sock: socket.socket) -> None:
    """Stop a socket another thread is using: the plain socket's shutdown, also for TLS (the
    SSLSocket's own would first unwrap TLS, and a concurrent send would write plaintext)."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
