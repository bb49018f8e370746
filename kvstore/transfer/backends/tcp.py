"""TCP data plane: one connection per transfer, payload received in place, TLS when configured.

The receiver connects to the sender's listener, presents the transfer id and the one-time
token from StartTransfer, and reads the wire header and then the payload with `recv_into`
straight into the destination tensor's memory (no intermediate buffer). Blocking sockets in
worker threads: the copies happen in the kernel with the GIL released, which on CPU hosts
beats an event-loop driven stream.

With TLS (`DataPlaneConfig.tls`, the gRPC hops' certificates) every connection is TLS, mutual
when a CA is given (`backends/tls.py`): the sender refuses plaintext (the handshake fails and
the connection is closed before a byte of KV is read) and the receiver never falls back to it.
The handshake runs in the per-connection worker, so a slow or silent client cannot stall the
accept loop.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import struct
import threading
from collections.abc import Mapping
from concurrent.futures import Executor

import torch

from pdmesh.kvstore.transfer.backends.availability import tcp_unavailable_reason
from pdmesh.kvstore.transfer.backends.base import (
    DataPlaneClient,
    DataPlaneConfig,
    DataPlaneServer,
    run_blocking,
)
from pdmesh.kvstore.transfer.backends.tls import client_context, server_context
from pdmesh.kvstore.transfer.checksum import tensor_bytes
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import (
    KVBackendUnavailable,
    KVSenderUnavailable,
    KVTransferError,
    KVTransferTimeout,
    KVWireError,
)
from pdmesh.kvstore.transfer.handle import KVHandle, log_id
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


unavailable_reason = tcp_unavailable_reason


class Server(DataPlaneServer):
    name = "tcp"

    _sock: socket.socket | None = None
    _tls: ssl.SSLContext | None = None
    _accept_thread: threading.Thread | None = None

    async def start(self) -> None:
        self._tls = server_context(self.config.tls)
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
        params = {"host": self.config.advertise_host, "port": str(self._port),
                  "token": grant.token}
        if self._tls is not None:
            params["tls"] = "1"
        return params

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
            if self._tls is not None:
                # Wrapped here, not in the accept loop: the handshake is bounded by the
                # timeout above and a plaintext client fails it before we read anything.
                conn = self._tls.wrap_socket(conn, server_side=True,
                                             do_handshake_on_connect=False)
                conn.do_handshake()
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
            # The receiver learns the reason from the control plane; here we only log
            # (ssl.SSLError is an OSError: plaintext or untrusted clients end here).
            logger.debug("tcp send ended early: %s", exc)
        finally:
            conn.close()
            self._slots.release()
            with self._workers_lock:
                self._workers.discard(threading.current_thread())


class Client(DataPlaneClient):
    name = "tcp"

    def __init__(self, config: DataPlaneConfig, executor: Executor | None = None) -> None:
        super().__init__(config, executor)
        self._tls = client_context(config.tls)

    async def receive(
        self,
        handle: KVHandle,
        params: Mapping[str, str],
        out: torch.Tensor,
        deadline: Deadline,
    ) -> None:
        host, port, token = params["host"], int(params["port"]), params["token"]
        tls = self._tls
        if tls is None and params.get("tls") == "1":
            raise KVBackendUnavailable(
                "the sender's tcp data plane requires TLS; configure --tls-cert/--tls-key "
                "(and --tls-ca) on this instance too",
                transfer_id=handle.transfer_id, request_id=handle.request_id,
            )
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        if tls is not None:
            # Wrapped before connecting so `_shutdown` (the abort) acts on the same socket;
            # the handshake, host-name check included, happens in connect().
            sock = tls.wrap_socket(sock, server_hostname=host.strip("[]"))
        try:
            await run_blocking(
                lambda: _pull(sock, (host, port), handle, token, out, deadline),
                abort=lambda: _shutdown(sock),
                deadline=deadline,
                grace_s=self.config.grace_s,
                executor=self.executor,
                what=f"tcp receive of {log_id(handle.transfer_id)}",
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
            f"tcp receive of {log_id(handle.transfer_id)} timed out",
            transfer_id=handle.transfer_id,
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
    """Stop a socket another thread is using. For a TLS socket this must be the *socket's*
    shutdown: `SSLSocket.shutdown` first drops the TLS layer, and a concurrent `send` would
    then write plaintext."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
