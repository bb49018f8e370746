"""torch.distributed point-to-point data plane (gloo on CPU, NCCL for CUDA tensors).

Each transfer gets its own two-rank rendezvous: the sender opens a `TCPStore` on an ephemeral
port, puts the wire header under a key prefixed with the one-time token, and builds a
process group as rank 0; the receiver joins as rank 1, checks the header, and `recv`s the
payload into the destination tensor's bytes. A group per transfer costs a few milliseconds
of setup but never leaves two engines' collectives entangled. The store is not
authenticated; the token prefix only keeps stray clients out of the rendezvous keys.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
from collections.abc import Mapping

import torch

from pdmesh.kvstore.connector.dist_blocks import process_group, settle
from pdmesh.kvstore.transfer.backends.availability import torch_dist_unavailable_reason
from pdmesh.kvstore.transfer.backends.base import DataPlaneClient, DataPlaneServer, run_blocking
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import (
    KVSenderUnavailable,
    KVTransferError,
    KVTransferTimeout,
    KVWireError,
)
from pdmesh.kvstore.transfer.handle import KVHandle, log_id
from pdmesh.kvstore.transfer.lease import Grant
from pdmesh.kvstore.transfer.wire import MAX_HEADER_BYTES, check_header, decode_header

logger = logging.getLogger(__name__)

_TAG = 0
_STORE_TIMEOUT_S = 3.0


unavailable_reason = torch_dist_unavailable_reason


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.05))


def _payload(kv: torch.Tensor) -> torch.Tensor:
    # Raw bytes: gloo lacks some float types, and bytes are what the checksum covers.
    return kv.reshape(-1).view(torch.uint8)


class Server(DataPlaneServer):
    name = "torch_dist"

    async def start(self) -> None:
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    async def prepare(self, grant: Grant) -> dict[str, str]:
        seconds = min(self.table.remaining(grant.transfer_id), self.config.io_timeout_s)
        store = torch.distributed.TCPStore(
            self.config.host, 0, 2, True, timeout=_timeout(seconds), wait_for_workers=False
        )
        scoped = torch.distributed.PrefixStore(f"{grant.token}/", store)
        scoped.set("header", grant.header)
        kind = "nccl" if self._source_is_cuda(grant) else "gloo"
        thread = threading.Thread(
            target=self._send, args=(grant, store, scoped, kind, seconds),
            name="kv-dist-send", daemon=True,
        )
        with self._lock:
            self._threads.add(thread)
        thread.start()
        return {
            "host": self.config.advertise_host,
            "port": str(store.port),
            "token": grant.token,
            "group": kind,
        }

    def _source_is_cuda(self, grant: Grant) -> bool:
        with self.table.reading(grant.transfer_id, grant.token, abort=lambda: None) as src:
            return src.kv.is_cuda

    def _send(
        self,
        grant: Grant,
        store: torch.distributed.TCPStore,
        scoped: torch.distributed.Store,
        kind: str,
        seconds: float,
    ) -> None:
        try:
            # Gloo ops cannot be interrupted; the group's timeout bounds them instead.
            with self.table.reading(grant.transfer_id, grant.token, abort=lambda: None) as src:
                group = process_group(scoped, 0, kind, self.config.advertise_host, seconds)
                group.send([_payload(src.kv)], 1, _TAG).wait(_timeout(seconds))
                settle(kind, src.kv)
                # Keep the store up until the receiver has everything it needs from it.
                scoped.wait(["done"], _timeout(seconds))
        except (RuntimeError, KVTransferError) as exc:
            logger.debug("torch_dist send of %s ended early: %s", log_id(grant.transfer_id),
                         exc)
        finally:
            del store
            with self._lock:
                self._threads.discard(threading.current_thread())

    async def close(self) -> None:
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=self.config.grace_s)


class Client(DataPlaneClient):
    name = "torch_dist"

    async def receive(
        self,
        handle: KVHandle,
        params: Mapping[str, str],
        out: torch.Tensor,
        deadline: Deadline,
    ) -> None:
        kind = params.get("group", "gloo")
        if kind not in ("gloo", "nccl"):
            raise KVWireError(f"unknown process group kind {kind!r}")
        if (kind == "nccl") != out.is_cuda:
            raise KVWireError(f"{kind} group needs a {'CUDA' if kind == 'nccl' else 'CPU'} tensor")
        handoff = _Handoff(out)
        await run_blocking(
            lambda: _pull(params, kind, handle, handoff, deadline),
            abort=handoff.abort,
            deadline=deadline,
            grace_s=0.0,  # after abort() the worker can no longer touch `out`
            executor=self.executor,
            what=f"torch_dist receive of {log_id(handle.transfer_id)}",
        )


class _Handoff:
    """Receives into a private buffer and copies into `out` only if not aborted.

    Gloo and NCCL operations cannot be interrupted (ProcessGroupGloo.abort does not stop a
    pending recv), so an abandoned worker may run until its timeout; staging keeps it from
    writing into blocks the caller has already reused. Costs one extra copy.
    """

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out
        self.staging = torch.empty_like(out)
        self._lock = threading.Lock()
        self._aborted = False

    def abort(self) -> None:
        with self._lock:
            self._aborted = True

    def deliver(self) -> None:
        with self._lock:
            if self._aborted:
                raise KVTransferTimeout("torch_dist receive was abandoned")
            self.out.copy_(self.staging)


def _pull(
    params: Mapping[str, str], kind: str, handle: KVHandle, handoff: _Handoff, deadline: Deadline
) -> None:
    host, port = params["host"], int(params["port"])
    try:
        # c10d retries refused connections until its timeout (and then some); a plain
        # connect first turns "sender already gone" into an immediate error.
        socket.create_connection((host, port), timeout=max(deadline.remaining(), 1e-3)).close()
        # The store exists before StartTransfer returns, so joining it is quick unless the
        # sender is gone; bound that case tightly (c10d retries once more after a timeout).
        store = torch.distributed.TCPStore(
            host, port, 2, False, timeout=_timeout(min(deadline.remaining(), _STORE_TIMEOUT_S))
        )
        scoped = torch.distributed.PrefixStore(f"{params['token']}/", store)
        header_bytes = scoped.get("header")
        if len(header_bytes) > MAX_HEADER_BYTES:
            raise KVWireError("oversized header in rendezvous store")
        check_header(decode_header(header_bytes), handle)
        group = process_group(scoped, 1, kind, _local_host(host), deadline.remaining())
        group.recv([_payload(handoff.staging)], 0, _TAG).wait(_timeout(deadline.remaining()))
        settle(kind, handoff.staging)
        scoped.set("done", "1")
        handoff.deliver()
    except (RuntimeError, OSError) as exc:  # c10d raises DistStoreError (a RuntimeError)
        if deadline.expired():
            raise KVTransferTimeout(
                f"torch_dist receive timed out: {exc}", transfer_id=handle.transfer_id
            ) from exc
        raise KVSenderUnavailable(
            f"torch_dist receive from {host}:{port} failed: {exc}",
            transfer_id=handle.transfer_id,
        ) from exc


def _local_host(peer: str) -> str:
    """Bind gloo's device on loopback for a loopback peer, else on our own hostname."""
    return "127.0.0.1" if peer.startswith("127.") or peer == "localhost" else ""
