"""`KVSender`: the prefill side. Publishes a request's KV and serves it until released.

    sender = KVSender(KVSenderConfig(host="10.0.0.5"), on_release=free_pinned_blocks)
    await sender.start()
    handle = sender.publish(request_id, kv_cache[:, :, block_ids], num_tokens)
    # ... hand `handle` to the router; decode pulls it; later, exactly once:
    # free_pinned_blocks(request_id, ReleaseReason.ACKED | FAILED | EXPIRED | CANCELLED | SHUTDOWN)

A growing export (`publish_stream`, Prefill.PrefillStream) is published before its prompt runs;
`stream_progress` records what the core made ready, which the receiver that started the
transfer follows with WatchTransfer (`export_streams.py`).

`on_release` may run on any thread (gRPC loop, a data-plane thread, the caller of `cancel`);
keep it short and thread-safe. `publish` and `cancel` are thread-safe too, so an engine
thread can call them while the control plane runs on the sender's event loop.

Observability (`sent_transfers.py`): each pull is one `pdmesh.kv_transfer` span from
StartTransfer to release and one observation in the `pdmesh:kv_transfer*` metrics
(direction="sent").

Security (docs/SECURITY.md): `tls` puts the control channel and the tcp data plane under TLS
(mutual with a CA) and refuses data planes without TLS (ucxx, torch_dist); `token` requires
the cluster token on the control channel and a router-signed capability in StartTransfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from pdmesh import grpc_common
from pdmesh.auth import ClusterToken, server_interceptors
from pdmesh.grpc_common import TLSConfig
from pdmesh.kvstore.connector.export_info import ExportProgress
from pdmesh.kvstore.transfer.backends import (
    TLS_SAFE_BACKENDS,
    DataPlaneConfig,
    DataPlaneServer,
    make_server,
)
from pdmesh.kvstore.transfer.backends.base import DEFAULT_SHM_DIR, format_host
from pdmesh.kvstore.transfer.backends.hostid import host_key
from pdmesh.kvstore.transfer.checksum import ChecksumAlgo, default_algo, tensor_checksum
from pdmesh.kvstore.transfer.control import KVTransferService, channel_options
from pdmesh.kvstore.transfer.errors import KVTransferError, KVTransferNotFound
from pdmesh.kvstore.transfer.export_streams import StreamedExports
from pdmesh.kvstore.transfer.handle import KVHandle, check_request_id
from pdmesh.kvstore.transfer.layout import KVLayout
from pdmesh.kvstore.transfer.lease import LeaseTable, ReleaseCallback
from pdmesh.kvstore.transfer.sent_transfers import SentTransfers
from pdmesh.kvstore.transfer.state import ReleaseReason, TransferState
from pdmesh.kvstore.transfer.ucx_plane import UcxPlane
from pdmesh.kvstore.transfer.wire import WireHeader, encode_header
from pdmesh.kvstore.transfer.worker_planes import (
    BlockServerPlane,
    CacheFilePlane,
    CoreCache,
    Exports,
    GroupPlane,
)
from pdmesh.metrics import KVTransferMetrics, kv_transfer_metrics
from pdmesh.v1 import kv_transfer_pb2 as pb
from pdmesh.v1 import kv_transfer_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    import torch

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


class _ObservedService(KVTransferService):
    """The control service, telling the sender when a pull starts (for its span and timing)."""

    def __init__(self, sender: KVSender, table: LeaseTable,
                 servers: dict[str, DataPlaneServer], token: ClusterToken | None) -> None:
        super().__init__(table, servers, token)
        self._sender = sender

    def _admit(self, request: pb.StartTransferRequest, server: DataPlaneServer) -> None:
        super()._admit(request, server)  # a refused caller starts no span and no timing
        self._sender.sent.started(request)

    async def CompleteTransfer(self, request: pb.CompleteTransferRequest,
                               context: grpc.aio.ServicerContext) -> pb.CompleteTransferReply:
        self._sender.sent.completed(request)
        return await super().CompleteTransfer(request, context)

    async def WatchTransfer(self, request: pb.WatchTransferRequest,
                            context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[pb.TransferProgress]:
        """A streamed export's progress, to the receiver that started its transfer."""
        if self.closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "KV sender is shutting down")
        try:
            reports = self._sender._watch(request.transfer_id, request.request_id)
            async for progress in reports:
                yield pb.TransferProgress(
                    first_index=progress.first_index, block_ids=progress.block_ids,
                    block_checksums=progress.block_checksums, sealed=progress.sealed,
                    failed=progress.failed)
        except KVTransferError as exc:
            code = (grpc.StatusCode.NOT_FOUND if isinstance(exc, KVTransferNotFound)
                    else grpc.StatusCode.FAILED_PRECONDITION)
            await context.abort(code, str(exc))


class KVSender:
    def __init__(
        self,
        config: KVSenderConfig,
        on_release: ReleaseCallback,
        *,
        server_credentials: grpc.ServerCredentials | None = None,
        tls: TLSConfig | None = None,
        token: ClusterToken | None = None,
        metrics: KVTransferMetrics | None = None,
        core: CoreCache | None = None,
        on_sent: Callable[[str, int], None] | None = None,
    ) -> None:
        """`tls`: PEM files for the control channel (unless `server_credentials` is given)
        and the tcp data plane. `token`: require the cluster token and capabilities.
        `core`: the engine core lends its blocks itself; `shm` and `tcp` are then its own
        transports (`publish_export`), and this process never touches KV bytes. `on_sent`:
        called with the bytes a receiver pulled when it acknowledged (any thread)."""
        if not config.backends:
            raise ValueError("a KV sender needs at least one backend")
        if tls is not None and tls.enabled:
            plain = [b for b in config.backends if b not in TLS_SAFE_BACKENDS]
            if plain:
                raise ValueError(f"KV backends {plain} have no TLS; with TLS configured use "
                                 f"{' or '.join(TLS_SAFE_BACKENDS)}")
            if server_credentials is None:
                server_credentials = grpc_common.server_credentials(tls)
        self.config = config
        self.core = core
        self._exports = Exports()
        self._streams = StreamedExports(self._exports)  # growing exports (PrefillStream)
        self.sender_id = uuid.uuid4().hex
        self._credentials = server_credentials
        self._token = token
        self._on_release = on_release
        self._on_sent = on_sent
        self.sent = SentTransfers(metrics or kv_transfer_metrics())  # spans and metrics
        self._table = LeaseTable(self._released, max_lease_s=config.max_lease_s)
        advertise = config.advertise_host or config.host
        self._plane = DataPlaneConfig(
            host=config.host,
            advertise_host=advertise,
            shm_dir=config.shm_dir,
            shm_pool_bytes=config.shm_pool_bytes,
            max_streams=config.max_streams,
            io_timeout_s=config.io_timeout_s,
            tls=tls,
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
        self._streams.loop = self._loop
        self._wake = asyncio.Event()
        for name in self.config.backends:
            server = self._worker_plane(name) or make_server(name, self._table, self._plane)
            await server.start()
            self._servers[name] = server
        challenge = getattr(self._servers.get("shm"), "challenge", None)
        if challenge is not None:
            self._host_key = challenge.key  # receivers prove they can read its nonce
        self._service = _ObservedService(self, self._table, self._servers, self._token)
        self._grpc = grpc.aio.server(
            options=channel_options(self.config.max_message_bytes),
            interceptors=server_interceptors(self._token),
        )
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

    def _worker_plane(self, name: str) -> DataPlaneServer | None:
        """The core's own transport for `name`, when the core lends its blocks itself."""
        if self.core is None or name not in self.core.backends():
            return None
        if name == "shm":
            return CacheFilePlane(self.core, self._exports, self.config.shm_dir)
        if name == "torch_dist":
            return GroupPlane(self.core, self._exports)
        if name == "ucxx":
            return UcxPlane(self.core, self._exports)
        return BlockServerPlane(self.core, self._exports, self._plane.tls is not None
                                and self._plane.tls.enabled)

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
        self.sent.offered(request_id, handle.transfer_id, kv.numel() * kv.element_size())
        self._table.add(handle, kv, header, self.config.lease_s if lease_s is None else lease_s)
        self._poke()
        return handle

    def publish_export(
        self, request_id: str, layout: KVLayout, block_ids: list[int],
        block_checksums: list[int], checksum_algo: ChecksumAlgo, *, lease_s: float | None = None,
    ) -> KVHandle:
        """Offer blocks the engine core lends (`AsyncEngine.export_kv`) for one pull by a
        receiver's core; only the core's own transports are offered. The blocks stay pinned
        in the core until `on_release` fires for this request."""
        if len(block_ids) != layout.num_blocks:
            raise KVTransferError(f"{len(block_ids)} block ids for {layout.num_blocks} blocks")
        handle = self._core_handle(request_id, layout, checksum_algo,
                                   block_checksums=tuple(block_checksums))
        self._exports.add(handle.transfer_id, tuple(block_ids))
        self._offer(handle, lease_s)
        return handle

    def publish_stream(
        self, request_id: str, layout: KVLayout, checksum_algo: ChecksumAlgo, *,
        lease_s: float | None = None,
    ) -> KVHandle:
        """Offer an export that still grows (its prefill runs, `PrefillStream`): its blocks
        become pullable as the core reports them (`stream_progress`). The handle has no
        block checksums yet; a receiver follows them with WatchTransfer. Event loop only."""
        handle = self._core_handle(request_id, layout, checksum_algo, streamed=True)
        self._streams.open(handle.transfer_id)
        self._offer(handle, lease_s)
        return handle

    def _core_handle(self, request_id: str, layout: KVLayout, checksum_algo: ChecksumAlgo, *,
                     block_checksums: tuple[int, ...] = (), streamed: bool = False) -> KVHandle:
        """A new handle for blocks the engine core lends: only its own transports offered."""
        check_request_id(request_id)
        offered = tuple(n for n in self._servers if isinstance(
            self._servers[n], CacheFilePlane | BlockServerPlane))
        if not offered:
            raise KVTransferError("this sender serves no engine-core transport")
        return KVHandle(
            transfer_id=uuid.uuid4().hex, request_id=request_id, sender_address=self.address,
            backends=offered, host_key=self._host_key, sender_id=self.sender_id,
            layout=layout, checksum_algo=checksum_algo, checksum=0,
            block_checksums=block_checksums, streamed=streamed)

    def _offer(self, handle: KVHandle, lease_s: float | None) -> None:
        """Put a core handle under its lease (ReleaseKV and Abort find it by request id)."""
        self.sent.offered(handle.request_id, handle.transfer_id, handle.layout.nbytes)
        self._table.add(handle, None, b"", self.config.lease_s if lease_s is None else lease_s)
        self._poke()

    def stream_progress(self, handle: KVHandle, progress: ExportProgress) -> KVHandle | None:
        """The core made more of a streamed export ready (or sealed, or failed it); when
        sealed, the handle with every block checksum (`StreamedExports.progress`). Event
        loop only."""
        return self._streams.progress(handle, progress)

    def _watch(self, transfer_id: str, request_id: str) -> AsyncIterator[ExportProgress]:
        """A started transfer's progress (NOT_FOUND for one never streamed or released)."""
        if not self.sent.is_started(request_id, transfer_id):
            raise KVTransferNotFound("no started streamed transfer", transfer_id=transfer_id)
        return self._streams.log.watch(transfer_id)

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

    def _released(self, request_id: str, reason: ReleaseReason) -> None:
        """The lease table's release callback: record the outcome, then the caller's one."""
        served = self.sent.pop(request_id)
        if served is not None:
            self._exports.pop(served.transfer_id)
            self._streams.end(served.transfer_id, f"transfer ended: {reason.name.lower()}")
        try:
            if served is not None:
                self.sent.observe(served, reason)
            if served is not None and reason is ReleaseReason.ACKED and self._on_sent:
                self._on_sent(request_id, served.nbytes)
        except Exception:  # observability must never keep pinned KV from being freed
            logger.exception("recording KV transfer %s failed", request_id)
        self._on_release(request_id, reason)

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
