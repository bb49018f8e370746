"""Plain TCP data plane: one connection per transfer, payload received in place.

The receiver connects to the sender's listener, presents the transfer id and the one-time
token from StartTransfer, and reads the wire header and then the payload with `recv_into`
straight into the destination tensor's memory (no intermediate buffer). Blocking sockets in
worker threads: the copies happen in the kernel with the GIL released, which on CPU hosts
beats an event-loop driven stream.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
from collections.abc import Mapping

import torch

from pdmesh.kvstore.transfer.backends.base import DataPlaneClient, DataPlaneServer, run_blocking
from pdmesh.kvstore.transfer.checksum import tensor_bytes
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import (
    KVSenderUnavailable,
    KVTransferError,
    KVTransferTimeout,
    KVWireError,
)
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.lease import Grant
from pdmesh.kvstore.transfer.wire import (
    FIXED_HEADER_BYTES,
    check_header,
    decode_header,
    header_length,
)

logger = logging.getLogger(__name__)

_REQUEST = struct.Struct("<4sBB")  # magic, transfer id length, token length
_REQUEST_MAGIC = b"PDKQ"
_MAX_ID = 64


def unavailable_reason() -> str | None:
    return None


def format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class Server(DataPlaneServer):
    name = "tcp"

    _sock: socket.socket | None = None
    _accept_thread: threading.Thread | None = None

    async def start(self) -> None:
        self._sock = socket.create_server((self.config.host, 0), backlog=128)
        self._port = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(self.config.max_streams)
        self._closed = threading.Event()
        self._workers: set[threading.Thread] = set()
        self._workers_lock = threading.Lock()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="kv-tcp-accept", daemon=True
        )
        self._accept_thread.start()

    async def prepare(self, grant: Grant) -> dict[str, str]:
        return {"host": self.config.advertise_host, "port": str(self._port), "token": grant.token}

    async def close(self) -> None:
        if self._sock is None:
            return
        self._closed.set()
        _shutdown(self._sock)
        self._sock.close()
        threads = [self._accept_thread] if self._accept_thread else []
        with self._workers_lock:
            threads += list(self._workers)
        for thread in threads:
            thread.join(timeout=self.config.grace_s)
            if thread.is_alive():
                logger.warning("tcp data-plane thread %s did not stop", thread.name)

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # listener closed
            # Bounded concurrency; poll the closed flag so close() is never stuck here.
            while not self._slots.acquire(timeout=0.2):
                if self._closed.is_set():
                    conn.close()
                    return
            worker = threading.Thread(
                target=self._serve, args=(conn,), name="kv-tcp-send", daemon=True
            )
            with self._workers_lock:
                self._workers.add(worker)
            worker.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self.config.io_timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            magic, tid_len, token_len = _REQUEST.unpack(_recv_exact(conn, _REQUEST.size))
            if magic != _REQUEST_MAGIC or tid_len > _MAX_ID or token_len > _MAX_ID:
                raise KVWireError("bad data-plane request")
            ids = _recv_exact(conn, tid_len + token_len)
            transfer_id, token = ids[:tid_len].decode(), ids[tid_len:].decode()
            with self.table.reading(transfer_id, token, abort=lambda: _shutdown(conn)) as src:
                kv = src.kv if src.kv.device.type == "cpu" else src.kv.cpu()
                conn.sendall(src.header)
                conn.sendall(tensor_bytes(kv))
        except (OSError, KVTransferError, UnicodeDecodeError) as exc:
            # The receiver learns the reason from the control plane; here we only log.
            logger.debug("tcp send ended early: %s", exc)
        finally:
            conn.close()
            self._slots.release()
            with self._workers_lock:
                self._workers.discard(threading.current_thread())


class Client(DataPlaneClient):
    name = "tcp"

    async def receive(
        self,
        handle: KVHandle,
        params: Mapping[str, str],
        out: torch.Tensor,
        deadline: Deadline,
    ) -> None:
        host, port, token = params["host"], int(params["port"]), params["token"]
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            await run_blocking(
                lambda: _pull(sock, (host, port), handle, token, out, deadline),
                abort=lambda: _shutdown(sock),
                deadline=deadline,
                grace_s=self.config.grace_s,
                executor=self.executor,
                what=f"tcp receive of {handle.transfer_id}",
            )
        finally:
            sock.close()


def _pull(
    sock: socket.socket,
    address: tuple[str, int],
    handle: KVHandle,
    token: str,
    out: torch.Tensor,
    deadline: Deadline,
) -> None:
    tid = handle.transfer_id.encode()
    try:
        sock.settimeout(max(deadline.remaining(), 1e-3))
        sock.connect(address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(_REQUEST.pack(_REQUEST_MAGIC, len(tid), len(token)) + tid + token.encode())
        prefix = _recv_exact(sock, FIXED_HEADER_BYTES, deadline)
        rest = _recv_exact(sock, header_length(prefix) - FIXED_HEADER_BYTES, deadline)
        check_header(decode_header(prefix + rest), handle)
        _recv_into_exact(sock, tensor_bytes(out), deadline)
    except TimeoutError:
        raise KVTransferTimeout(
            f"tcp receive of {handle.transfer_id} timed out", transfer_id=handle.transfer_id,
            request_id=handle.request_id,
        ) from None
    except OSError as exc:
        raise KVSenderUnavailable(
            f"tcp data plane to {address[0]}:{address[1]} failed: {exc}",
            transfer_id=handle.transfer_id, request_id=handle.request_id,
        ) from exc


def _recv_exact(sock: socket.socket, n: int, deadline: Deadline | None = None) -> bytes:
    buf = bytearray(n)
    _recv_into_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def _recv_into_exact(sock: socket.socket, view: memoryview, deadline: Deadline | None) -> None:
    total, got = len(view), 0
    while got < total:
        if deadline is not None:
            remaining = deadline.remaining()
            if remaining <= 0:
                raise TimeoutError
            sock.settimeout(remaining)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {total} bytes")
        got += n


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
