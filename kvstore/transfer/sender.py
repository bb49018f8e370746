"""`KVSender`: the prefill side. Publishes a request's KV and serves it until released.

    sender = KVSender(KVSenderConfig(host="10.0.0.5"), on_release=free_pinned_blocks)
    await sender.start()
    handle = sender.publish(request_id, kv_cache[:, :, block_ids], num_tokens)
    # ... hand `handle` to the router; decode pulls it; later, exactly once:
    # free_pinned_blocks(request_id, ReleaseReason.ACKED | FAILED | EXPIRED | CANCELLED | SHUTDOWN)

`on_release` may run on any thread (gRPC loop, a data-plane thread, the caller of `cancel`);
keep it short and thread-safe. `publish` and `cancel` are thread-safe too, so an engine
thread can call them while the control plane runs on the sender's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from dataclasses import dataclass, field

import grpc
import torch

from pdmesh.kvstore.transfer.backends import DataPlaneConfig, DataPlaneServer, make_server
from pdmesh.kvstore.transfer.backends.base import DEFAULT_SHM_DIR
from pdmesh.kvstore.transfer.backends.hostid import host_key
from pdmesh.kvstore.transfer.backends.tcp import format_host
from pdmesh.kvstore.transfer.checksum import ChecksumAlgo, default_algo, tensor_checksum
from pdmesh.kvstore.transfer.control import KVTransferService, channel_options
from pdmesh.kvstore.transfer.errors import KVTransferError
from pdmesh.kvstore.transfer.handle import KVHandle, check_request_id
from pdmesh.kvstore.transfer.layout import KVLayout
from pdmesh.kvstore.transfer.lease import LeaseTable, ReleaseCallback
from pdmesh.kvstore.transfer.state import ReleaseReason, TransferState
from pdmesh.kvstore.transfer.wire import WireHeader, encode_header
from pdmesh.v1 import kv_transfer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVSenderConfig:
    host: str = "127.0.0.1"          # bind address of the control and data planes
    port: int = 0                    # control-plane port; 0 picks a free one
    advertise_host: str | None = None  # address receivers dial; defaults to `host`
    backends: tuple[str, ...] = ("shm", "tcp")  # data planes served, preferred first
    lease_s: float = 30.0
    max_lease_s: float = 300.0
    max_message_bytes: int = 4 << 20  # control messages are small; refuse anything big
    shm_dir: str = DEFAULT_SHM_DIR
    shm_pool_bytes: int = 1 << 30    # shm segments kept for reuse (fresh tmpfs pages are slow)
    max_streams: int = 16
    io_timeout_s: float = 30.0
    checksum_algo: ChecksumAlgo = field(default_factory=default_algo)


class KVSender:
    def __init__(
        self,
        config: KVSenderConfig,
        on_release: ReleaseCallback,
        *,
        server_credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        if not config.backends:
            raise ValueError("a KV sender needs at least one backend")
        self.config = config
        self.sender_id = uuid.uuid4().hex
        self._credentials = server_credentials
        self._table = LeaseTable(on_release, max_lease_s=config.max_lease_s)
        advertise = config.advertise_host or config.host
        self._plane = DataPlaneConfig(
            host=config.host,
            advertise_host=advertise,
            shm_dir=config.shm_dir,
            shm_pool_bytes=config.shm_pool_bytes,
            max_streams=config.max_streams,
            io_timeout_s=config.io_timeout_s,
        )
        self._host_key = host_key(os.path.realpath(config.shm_dir))
        self._servers: dict[str, DataPlaneServer] = {}
        self._grpc: grpc.aio.Server | None = None
        self._service: KVTransferService | None = None
        self._expiry: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._address = ""

    @property
    def address(self) -> str:
        """host:port of the control plane, as put into handles."""
        if not self._address:
            raise KVTransferError("KV sender is not started")
        return self._address

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        for name in self.config.backends:
            server = make_server(name, self._table, self._plane)
            await server.start()
            self._servers[name] = server
        self._service = KVTransferService(self._table, self._servers)
        self._grpc = grpc.aio.server(options=channel_options(self.config.max_message_bytes))
        pb_grpc.add_KVTransferServicer_to_server(self._service, self._grpc)
        bind = f"{format_host(self.config.host)}:{self.config.port}"
        if self._credentials is None:
            port = self._grpc.add_insecure_port(bind)
        else:
            port = self._grpc.add_secure_port(bind, self._credentials)
        await self._grpc.start()
        self._address = f"{format_host(self._plane.advertise_host)}:{port}"
        self._expiry = asyncio.create_task(self._expire_loop(), name="kv-lease-expiry")
        logger.info("KV sender %s on %s, backends %s", self.sender_id, self._address,
                    ",".join(self._servers))

    async def stop(self, grace_s: float = 1.0) -> None:
        """Release everything still held (reason SHUTDOWN) and stop serving."""
        if self._service is not None:
            self._service.closing = True
        self._table.shutdown()  # aborts in-flight streams, releases their KV
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        for server in self._servers.values():
            await server.close()
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        self._address = ""

    async def __aenter__(self) -> KVSender:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # -- the prefill service's calls (thread-safe) -------------------------------------------

    def publish(
        self, request_id: str, kv: torch.Tensor, num_tokens: int, *, lease_s: float | None = None
    ) -> KVHandle:
        """Offer `kv` ([layers, 2, blocks, block_size, kv_heads, head_dim]) for one pull.

        The tensor is kept by reference (made contiguous if it is not) until release; the
        caller must not overwrite it before `on_release` fires for this request.
        """
        check_request_id(request_id)
        layout = KVLayout.of(kv, num_tokens)
        kv = kv.detach().contiguous()
        handle = KVHandle(
            transfer_id=uuid.uuid4().hex,
            request_id=request_id,
            sender_address=self.address,
            backends=tuple(self._servers),
            host_key=self._host_key,
            sender_id=self.sender_id,
            layout=layout,
            checksum_algo=self.config.checksum_algo,
            checksum=tensor_checksum(self.config.checksum_algo, kv),
        )
        header = encode_header(WireHeader.for_handle(handle))
        self._table.add(handle, kv, header, self.config.lease_s if lease_s is None else lease_s)
        self._poke()
        return handle

    def cancel(self, transfer_id: str, detail: str = "cancelled by sender") -> TransferState:
        """Withdraw a transfer (e.g. the request was aborted); in-flight streams are cut."""
        return self._table.cancel(transfer_id, ReleaseReason.CANCELLED, detail=detail)

    def extend(self, transfer_id: str, seconds: float) -> float:
        return self._table.extend(transfer_id, None, seconds)

    def state(self, transfer_id: str) -> TransferState:
        return self._table.state(transfer_id)

    def pinned_count(self) -> int:
        """Transfers whose KV is still held; 0 once everything was released."""
        return self._table.pinned_count()

    # -- lease expiry ------------------------------------------------------------------------

    def _poke(self) -> None:
        """Wake the expiry loop so it sees a new, possibly earlier, deadline."""
        if self._loop is None or self._wake is None:
            return
        with contextlib.suppress(RuntimeError):  # loop already closed
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _expire_loop(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            due = self._table.expire_due()
            timeout = 1.0 if due is None else min(max(due, 0.001), 1.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
