"""The gRPC control channel: the sender's `KVTransfer` service and the receiver's client.

The control plane only decides and records (start, ack, fail, extend, cancel); bytes travel
on a data plane. Errors cross as gRPC status codes with the transfer state in the trailing
metadata key `pdmesh-kv-state`, and come out on the receiver as the same
`KVTransferError` subclasses the sender raised.

Who may start a transfer: with a cluster token, only the holder of the router's capability
for it (`capability.py`); for shm, only a receiver that proves it shares the shm directory
(`DataPlaneServer.refusal`). Both are checked before the transfer starts, so a refused caller
leaves it PENDING for the rightful receiver. Logs name transfers by `log_id` only.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from pdmesh.auth import ClusterToken
from pdmesh.kvstore.connector.export_info import ExportProgress
from pdmesh.kvstore.transfer.backends.base import DataPlaneServer
from pdmesh.kvstore.transfer.capability import TransferCapability
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import (
    KVHandleError,
    KVSenderUnavailable,
    KVTransferCancelled,
    KVTransferDenied,
    KVTransferError,
    KVTransferExpired,
    KVTransferFailed,
    KVTransferNotFound,
    KVTransferRejected,
    KVTransferTimeout,
)
from pdmesh.kvstore.transfer.handle import KVHandle, log_id
from pdmesh.kvstore.transfer.lease import LeaseTable
from pdmesh.kvstore.transfer.state import ReleaseReason, TransferState
from pdmesh.v1 import kv_transfer_pb2 as pb
from pdmesh.v1 import kv_transfer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

STATE_KEY = "pdmesh-kv-state"
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")

R = TypeVar("R")


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def _ms(seconds: float) -> int:
    return max(0, min(int(seconds * 1000), 2**32 - 1))


def _trace(traceparent: str, what: str, transfer_id: str) -> None:
    if traceparent and _TRACEPARENT.fullmatch(traceparent):
        logger.debug("%s %s traceparent=%s", what, log_id(transfer_id), traceparent)


class KVTransferService(pb_grpc.KVTransferServicer):
    """Sender side of the control channel, serving one `LeaseTable`."""

    def __init__(
        self,
        table: LeaseTable,
        servers: Mapping[str, DataPlaneServer],
        token: ClusterToken | None = None,
    ) -> None:
        self._table = table
        self._servers = servers
        self._token = token
        self.closing = False

    async def StartTransfer(
        self, request: pb.StartTransferRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartTransferReply:
        async def run() -> pb.StartTransferReply:
            _trace(request.traceparent, "start", request.transfer_id)
            server = self._servers.get(request.backend)
            if server is None:
                raise KVTransferRejected(f"backend {request.backend!r} is not served here")
            self._admit(request, server)
            grant = self._table.start(
                request.transfer_id, request.request_id, request.backend, request.lease_ms / 1000
            )
            try:
                params = await server.prepare(grant)
            except BaseException as exc:
                # The bytes cannot be offered: fail the transfer so the KV is released now,
                # and tell the receiver the state that explains it (it may have been a cancel).
                self._table.cancel(
                    grant.transfer_id, ReleaseReason.FAILED, detail=f"data plane: {exc!r}"
                )
                ended = self._table.ended_error(grant.transfer_id)
                if isinstance(exc, Exception) and ended is not None:
                    raise ended from exc
                raise
            return pb.StartTransferReply(
                state=pb.KV_TRANSFER_STATE_TRANSFERRING,
                params=params,
                lease_remaining_ms=_ms(self._table.remaining(grant.transfer_id)),
            )

        return await self._guard(context, request.transfer_id, run)

    def _admit(self, request: pb.StartTransferRequest, server: DataPlaneServer) -> None:
        """Refuse (KVTransferDenied) a caller the router did not send, or an shm reader on
        another host; nothing about the transfer changes."""
        if self._token is not None:
            capability = TransferCapability.from_proto(request.capability)
            problem = capability.check(self._token, request.transfer_id)
            if problem is not None:
                raise KVTransferDenied(problem)
        problem = server.refusal(request.transfer_id, request.receiver_host_key)
        if problem is not None:
            raise KVTransferDenied(problem)

    async def CompleteTransfer(
        self, request: pb.CompleteTransferRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompleteTransferReply:
        async def run() -> pb.CompleteTransferReply:
            _trace(request.traceparent, "complete", request.transfer_id)
            state = self._table.complete(
                request.transfer_id, request.request_id, request.ok, request.error[:1024]
            )
            return pb.CompleteTransferReply(state=state.value)

        return await self._guard(context, request.transfer_id, run)

    async def ExtendLease(
        self, request: pb.ExtendLeaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExtendLeaseReply:
        async def run() -> pb.ExtendLeaseReply:
            _trace(request.traceparent, "extend", request.transfer_id)
            remaining = self._table.extend(
                request.transfer_id, request.request_id, request.extend_ms / 1000
            )
            state = self._table.state(request.transfer_id)
            return pb.ExtendLeaseReply(state=state.value, lease_remaining_ms=_ms(remaining))

        return await self._guard(context, request.transfer_id, run)

    async def CancelTransfer(
        self, request: pb.CancelTransferRequest, context: grpc.aio.ServicerContext
    ) -> pb.CancelTransferReply:
        async def run() -> pb.CancelTransferReply:
            _trace(request.traceparent, "cancel", request.transfer_id)
            state = self._table.cancel(
                request.transfer_id,
                request_id=request.request_id,
                detail=f"receiver: {request.reason[:256] or 'cancelled'}",
            )
            return pb.CancelTransferReply(state=state.value)

        return await self._guard(context, request.transfer_id, run)

    async def _guard(
        self, context: grpc.aio.ServicerContext, transfer_id: str, run: Callable[[], Awaitable[R]]
    ) -> R:
        if self.closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "KV sender is shutting down")
        try:
            return await run()
        except KVTransferError as exc:
            code = _status_for(exc)
            metadata = ((STATE_KEY, exc.state.name),) if exc.state is not None else ()
            await context.abort(code, str(exc), trailing_metadata=metadata)
        raise AssertionError("unreachable: context.abort raises")


def _status_for(exc: KVTransferError) -> grpc.StatusCode:
    if isinstance(exc, KVTransferNotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, KVTransferDenied):
        return grpc.StatusCode.PERMISSION_DENIED
    if exc.state is not None:
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, KVTransferRejected | KVHandleError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


@dataclass(frozen=True)
class StartReply:
    params: dict[str, str]
    lease_remaining_s: float


class ControlClient:
    """Receiver side of the control channel for one sender address."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = pb_grpc.KVTransferStub(channel)

    async def start(
        self,
        handle: KVHandle,
        backend: str,
        host_proof: str,
        lease_s: float,
        deadline: Deadline,
        traceparent: str = "",
        capability: TransferCapability | None = None,
    ) -> StartReply:
        request = pb.StartTransferRequest(
            transfer_id=handle.transfer_id,
            request_id=handle.request_id,
            backend=backend,
            receiver_host_key=host_proof,
            lease_ms=_ms(lease_s),
            traceparent=traceparent,
            capability=capability.to_proto() if capability is not None else None,
        )
        reply = await self._call(self._stub.StartTransfer, request, handle, deadline)
        return StartReply(dict(reply.params), reply.lease_remaining_ms / 1000)

    async def complete(
        self, handle: KVHandle, ok: bool, error: str, deadline: Deadline, traceparent: str = "",
        pulled_bytes: int = 0,
    ) -> TransferState:
        request = pb.CompleteTransferRequest(
            transfer_id=handle.transfer_id,
            request_id=handle.request_id,
            ok=ok,
            error=error[:1024],
            traceparent=traceparent,
            pulled_bytes=pulled_bytes,
        )
        reply = await self._call(self._stub.CompleteTransfer, request, handle, deadline)
        return _state(reply.state)

    async def extend(
        self, handle: KVHandle, seconds: float, deadline: Deadline, traceparent: str = ""
    ) -> float:
        request = pb.ExtendLeaseRequest(
            transfer_id=handle.transfer_id,
            request_id=handle.request_id,
            extend_ms=_ms(seconds),
            traceparent=traceparent,
        )
        reply = await self._call(self._stub.ExtendLease, request, handle, deadline)
        return reply.lease_remaining_ms / 1000

    async def cancel(
        self, handle: KVHandle, reason: str, deadline: Deadline, traceparent: str = ""
    ) -> TransferState:
        request = pb.CancelTransferRequest(
            transfer_id=handle.transfer_id,
            request_id=handle.request_id,
            reason=reason[:256],
            traceparent=traceparent,
        )
        reply = await self._call(self._stub.CancelTransfer, request, handle, deadline)
        return _state(reply.state)

    async def watch(self, handle: KVHandle, deadline: Deadline, traceparent: str = ""
                    ) -> AsyncIterator[ExportProgress]:
        """A started streamed transfer's progress (WatchTransfer) until its last report;
        raises a `KVTransferError` when the stream breaks (the sender died) or ends early."""
        request = pb.WatchTransferRequest(transfer_id=handle.transfer_id,
                                          request_id=handle.request_id, traceparent=traceparent)
        call = self._stub.WatchTransfer(request, timeout=max(deadline.remaining(), 0.001))
        try:
            async for msg in call:
                progress = ExportProgress(msg.first_index, list(msg.block_ids),
                                          list(msg.block_checksums), str(handle.checksum_algo),
                                          sealed=msg.sealed, failed=msg.failed)
                yield progress
                if progress.sealed or progress.failed:
                    return
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, handle) from exc
        finally:
            call.cancel()
        raise KVTransferFailed("the sender's progress stream ended before its seal",
                               transfer_id=handle.transfer_id, request_id=handle.request_id)

    @staticmethod
    async def _call(method: Any, request: Any, handle: KVHandle, deadline: Deadline) -> Any:
        remaining = deadline.remaining()
        if remaining <= 0:
            raise KVTransferTimeout(
                "deadline exceeded before the control call",
                transfer_id=handle.transfer_id, request_id=handle.request_id,
            )
        try:
            return await method(request, timeout=remaining)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, handle) from exc


def _state(value: int) -> TransferState:
    try:
        return TransferState(value)
    except ValueError:
        raise KVTransferError(f"sender replied with unknown state {value}") from None


_ERRORS_BY_STATE: dict[str, type[KVTransferError]] = {
    "EXPIRED": KVTransferExpired,
    "CANCELLED": KVTransferCancelled,
    "FAILED": KVTransferFailed,
}


def error_from_rpc(exc: grpc.aio.AioRpcError, handle: KVHandle) -> KVTransferError:
    """Turn a failed control call into the precise `KVTransferError` subclass."""
    code = exc.code()
    text = f"{code.name} from {handle.sender_address}: {exc.details()}"
    state_name = ""
    for key, value in exc.trailing_metadata() or ():
        if key == STATE_KEY:
            state_name = value if isinstance(value, str) else value.decode()
    error_type: type[KVTransferError]
    if code == grpc.StatusCode.NOT_FOUND:
        error_type = KVTransferNotFound
    elif code == grpc.StatusCode.FAILED_PRECONDITION:
        error_type = _ERRORS_BY_STATE.get(state_name, KVTransferRejected)
    elif code == grpc.StatusCode.INVALID_ARGUMENT:
        error_type = KVTransferRejected
    elif code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
        error_type = KVTransferDenied
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        error_type = KVTransferTimeout
    elif code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        error_type = KVSenderUnavailable
    else:
        error_type = KVTransferError
    error = error_type(text, transfer_id=handle.transfer_id, request_id=handle.request_id)
    if state_name in TransferState.__members__:
        error.state = TransferState[state_name]
    return error
