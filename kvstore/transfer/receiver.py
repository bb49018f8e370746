"""`KVReceiver`: the decode side. Pulls a published KV, verifies it, acknowledges it.

    receiver = KVReceiver()
    kv = await receiver.fetch(handle, deadline=5.0)      # or Deadline.after(5.0)
    kv_cache[:, :, dst_block_ids] = kv

`fetch` returns only a tensor whose header matched the handle, whose checksum matched the
sender's, and whose ack the sender accepted (so a lease that ran out or a cancel that raced
the copy is reported, never silently served). Every failure is a `KVTransferError`
subclass raised by the deadline; the caller falls back to recompute or fails the request.

Observability: each fetch is one `pdmesh.kv_transfer` span (kind CLIENT; parent: the
`traceparent` given, else the current span) whose context travels to the sender in the control
messages, and one observation in the `pdmesh:kv_transfer*` metrics (direction="received").
Spans and logs name a transfer by its `log_id`, never its id.

Security (docs/SECURITY.md): `tls` puts the control channel and the tcp data plane under TLS
and keeps this receiver off data planes without it; `token` adds the cluster token to every
control call; `fetch(capability=...)` presents the router's capability for the transfer.
shm is chosen only when we can prove to the sender that we read its shm directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from pdmesh.auth import ClusterToken, client_interceptors
from pdmesh.grpc_common import TLSConfig
from pdmesh.grpc_common import channel_credentials as tls_channel_credentials
from pdmesh.kvstore.transfer.backends import (
    TLS_SAFE_BACKENDS,
    DataPlaneClient,
    DataPlaneConfig,
    make_client,
    unavailable_reason,
)
from pdmesh.kvstore.transfer.backends.base import DEFAULT_SHM_DIR
from pdmesh.kvstore.transfer.backends.hostid import host_proof
from pdmesh.kvstore.transfer.capability import TransferCapability
from pdmesh.kvstore.transfer.checksum import tensor_checksum
from pdmesh.kvstore.transfer.control import ControlClient, channel_options
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import (
    KVBackendUnavailable,
    KVChecksumError,
    KVTransferCancelled,
    KVTransferError,
    KVTransferExpired,
    KVTransferTimeout,
    failure_outcome,
)
from pdmesh.kvstore.transfer.handle import KVHandle, log_id
from pdmesh.kvstore.transfer.state import TransferState
from pdmesh.metrics import KVTransferMetrics, kv_transfer_metrics
from pdmesh.tracing import (
    Span,
    SpanKind,
    context_from_traceparent,
    get_tracer,
    mark_error,
    span_traceparent,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_PRECISE_BY_STATE: dict[TransferState, type[KVTransferError]] = {
    TransferState.EXPIRED: KVTransferExpired,
    TransferState.CANCELLED: KVTransferCancelled,
}
@dataclass(frozen=True)
class KVReceiverConfig:
    backends: tuple[str, ...] = ("shm", "ucxx", "tcp", "torch_dist")  # preference order
    shm_dir: str = DEFAULT_SHM_DIR
    max_message_bytes: int = 4 << 20
    lease_margin_s: float = 5.0    # ask the sender to hold the KV this long past our deadline
    notify_timeout_s: float = 2.0  # budget of best-effort failure and cancel notices
    grace_s: float = 2.0           # how long an aborted data-plane worker may take to stop
    heartbeat_s: float = 1.0       # lease heartbeat while bytes move; also detects a dead sender
    max_workers: int = 8           # threads for blocking data-plane I/O


class KVReceiver:
    def __init__(
        self,
        config: KVReceiverConfig | None = None,
        *,
        channel_credentials: grpc.ChannelCredentials | None = None,
        tls: TLSConfig | None = None,
        token: ClusterToken | None = None,
        metrics: KVTransferMetrics | None = None,
    ) -> None:
        """`tls`: PEM files for the control channel (unless `channel_credentials` is given)
        and the tcp data plane. `token`: the cluster token, sent on every control call."""
        self.config = config or KVReceiverConfig()
        self.metrics = metrics or kv_transfer_metrics()
        self._preferences = self.config.backends
        if tls is not None and tls.enabled:
            if channel_credentials is None:
                channel_credentials = tls_channel_credentials(tls)
            self._preferences = tuple(b for b in self._preferences if b in TLS_SAFE_BACKENDS)
            if not self._preferences:
                raise ValueError(f"KV backends {self.config.backends} have no TLS; with TLS "
                                 f"configured use {' or '.join(TLS_SAFE_BACKENDS)}")
        self._credentials = channel_credentials
        self._interceptors = client_interceptors(token)
        self._plane = DataPlaneConfig(shm_dir=self.config.shm_dir, grace_s=self.config.grace_s,
                                      tls=tls)
        self._executor = ThreadPoolExecutor(self.config.max_workers, "kv-recv")
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._clients: dict[str, DataPlaneClient] = {}
        self._notices: set[asyncio.Task[Any]] = set()

    def choose_backend(self, handle: KVHandle, among: tuple[str, ...] | None = None) -> str:
        """shm when we can prove we share the sender's shm directory, else our first
        preference offered (and, with `among`, one of those: what our engine core runs)."""
        offered = set(handle.backends)
        for name in self._preferences:
            if name not in offered or (among is not None and name not in among):
                continue
            if name == "shm" and self.host_proof(handle) is None:
                continue
            if unavailable_reason(name) is None:
                return name
        raise KVBackendUnavailable(
            f"no usable backend: sender offers {handle.backends}, receiver accepts "
            f"{self._preferences}", transfer_id=handle.transfer_id,
        )

    async def fetch(
        self,
        handle: KVHandle,
        deadline: Deadline | float = 30.0,
        *,
        out: torch.Tensor | None = None,
        backend: str | None = None,
        traceparent: str = "",
        capability: TransferCapability | None = None,
    ) -> torch.Tensor:
        """Pull, verify and ack the KV of `handle`; `deadline` is a Deadline or seconds.

        `out`, if given, must be a contiguous tensor of the handle's layout; it is filled in
        place (and is garbage if this raises). `traceparent` parents this transfer's span
        (default: the current span). `capability`: the router's grant of this transfer to us,
        required by senders of a mesh with a cluster token (`KVTransferDenied` without it).
        """
        started = time.monotonic()
        name = backend or ""
        span = transfer_span(handle, traceparent)
        try:
            name = backend or self.choose_backend(handle)
            span.set_attribute("pdmesh.kv.backend", name)
            dst = await self._fetch(
                handle, Deadline.coerce(deadline), out, name, span_traceparent(span), capability
            )
        except BaseException as exc:
            outcome = failure_outcome(exc)
            self.metrics.observe("received", name or "none", 0, 0.0, outcome)
            span.set_attribute("pdmesh.kv.outcome", outcome)
            mark_error(span, exc)
            span.end()
            raise
        elapsed = time.monotonic() - started
        nbytes = dst.numel() * dst.element_size()
        self.metrics.observe("received", name, nbytes, elapsed, "ok")
        if span.is_recording():
            span.set_attributes({"pdmesh.kv.bytes": nbytes, "pdmesh.kv.outcome": "ok",
                                 "pdmesh.kv.duration_ms": elapsed * 1e3})
        span.end()
        return dst

    async def _fetch(
        self,
        handle: KVHandle,
        deadline: Deadline,
        out: torch.Tensor | None,
        name: str,
        traceparent: str,
        capability: TransferCapability | None = None,
    ) -> torch.Tensor:
        if name not in handle.backends:
            raise KVBackendUnavailable(f"sender does not offer backend {name!r}")
        client = self._client(name)
        dst = handle.layout.empty() if out is None else out
        handle.layout.check_tensor(dst)
        control = self.control(handle.sender_address)
        started = False
        try:
            proof = (self.host_proof(handle) or "") if name == "shm" else ""
            reply = await control.start(
                handle, name, proof, deadline.remaining() + self.config.lease_margin_s,
                deadline, traceparent, capability,
            )
            started = True
            await self._receive_watched(client, control, handle, reply.params, dst, deadline)
            await self._verify(handle, dst, deadline)
            await control.complete(handle, True, "", deadline, traceparent,
                                   pulled_bytes=dst.numel() * dst.element_size())
            return dst
        except asyncio.CancelledError:
            self.notify(control.cancel(handle, "receiver gave up", self.notice_deadline()))
            raise
        except KVTransferError as exc:
            if started and exc.state is None:
                raise await self._report_failure(control, handle, exc, deadline) from exc
            raise

    async def extend_lease(
        self, handle: KVHandle, seconds: float, deadline: Deadline | float = 5.0
    ) -> float:
        """Heartbeat: keep the sender holding the KV `seconds` longer (e.g. while queued)."""
        control = self.control(handle.sender_address)
        return await control.extend(handle, seconds, Deadline.coerce(deadline))

    async def cancel(
        self, handle: KVHandle, reason: str = "", deadline: Deadline | float = 5.0
    ) -> TransferState:
        """Tell the sender we will not pull this KV, so it is released now."""
        control = self.control(handle.sender_address)
        return await control.cancel(handle, reason, Deadline.coerce(deadline))

    async def close(self) -> None:
        if self._notices:
            await asyncio.wait(self._notices, timeout=self.config.notify_timeout_s)
        for client in self._clients.values():
            await client.close()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> KVReceiver:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- internals ---------------------------------------------------------------------------

    async def _receive_watched(
        self,
        client: DataPlaneClient,
        control: ControlClient,
        handle: KVHandle,
        params: dict[str, str],
        dst: torch.Tensor,
        deadline: Deadline,
    ) -> None:
        """Run the data plane while heartbeating the lease over the control channel.

        The heartbeat keeps a long transfer's lease alive and notices what a data plane may
        not: the sender process gone, or the transfer cancelled or expired on its side.
        """
        receive = asyncio.ensure_future(client.receive(handle, params, dst, deadline))
        watch = asyncio.ensure_future(self.heartbeat(control, handle, deadline))
        try:
            await asyncio.wait({receive, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not receive.done():
                receive.cancel()  # aborts the data plane and waits for it to let go of dst
                with contextlib.suppress(asyncio.CancelledError, KVTransferError):
                    await receive
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, KVTransferError):
                await watch
        if receive.cancelled() and watch.done() and not watch.cancelled():
            watch.result()  # raises the heartbeat's error
        receive.result()

    async def heartbeat(
        self, control: ControlClient, handle: KVHandle, deadline: Deadline
    ) -> None:
        """Extend the lease every `heartbeat_s`; raise once the sender says no or is gone."""
        interval = self.config.heartbeat_s
        while deadline.remaining() > interval:
            await asyncio.sleep(interval)
            call_deadline = Deadline.after(min(interval, deadline.remaining()))
            lease = deadline.remaining() + self.config.lease_margin_s
            try:
                await control.extend(handle, lease, call_deadline)
            except KVTransferTimeout:
                continue  # a slow sender is not a dead one; the fetch deadline bounds us
        await asyncio.Event().wait()  # no more heartbeats: wait to be cancelled

    async def _verify(self, handle: KVHandle, dst: torch.Tensor, deadline: Deadline) -> None:
        loop = asyncio.get_running_loop()
        actual = await asyncio.wait_for(
            loop.run_in_executor(
                self._executor, tensor_checksum, handle.checksum_algo, dst
            ),
            deadline.remaining(),
        )
        if actual != handle.checksum:
            raise KVChecksumError(
                f"{handle.checksum_algo} checksum mismatch: got {actual:016x}, "
                f"expected {handle.checksum:016x}",
                transfer_id=handle.transfer_id, request_id=handle.request_id,
            )

    async def _report_failure(
        self, control: ControlClient, handle: KVHandle, exc: KVTransferError, deadline: Deadline
    ) -> KVTransferError:
        """Tell the sender; if it had already ended the transfer, say why instead."""
        if isinstance(exc, KVTransferTimeout) or deadline.remaining() <= 0:
            self.notify(control.complete(handle, False, str(exc), self.notice_deadline()))
            return exc
        notice = Deadline.after(min(deadline.remaining(), self.config.notify_timeout_s))
        try:
            state = await control.complete(handle, False, str(exc), notice)
        except KVTransferError as notify_exc:
            logger.debug("failure notice for %s failed: %s", log_id(handle.transfer_id),
                         notify_exc)
            return exc
        precise = _PRECISE_BY_STATE.get(state)
        if precise is None:
            return exc
        error = precise(
            f"transfer {log_id(handle.transfer_id)} was {state.name.lower()} by the sender "
            f"({exc})",
            transfer_id=handle.transfer_id, request_id=handle.request_id,
        )
        error.state = state
        return error

    def notice_deadline(self) -> Deadline:
        return Deadline.after(self.config.notify_timeout_s)

    def notify(self, notice: Coroutine[Any, Any, Any]) -> None:
        """Send a best-effort notice without delaying the caller past its deadline."""

        async def run() -> None:
            with contextlib.suppress(KVTransferError):
                await notice

        task = asyncio.get_running_loop().create_task(run())
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    def host_proof(self, handle: KVHandle) -> str | None:
        return host_proof(self.config.shm_dir, handle.host_key, handle.transfer_id)

    def _client(self, name: str) -> DataPlaneClient:
        if name not in self._clients:
            self._clients[name] = make_client(name, self._plane, self._executor)
        return self._clients[name]

    def control(self, address: str) -> ControlClient:
        channel = self._channels.get(address)
        if channel is None:
            options = channel_options(self.config.max_message_bytes)
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(address, options=options,
                                                    interceptors=self._interceptors)
            else:
                channel = grpc.aio.secure_channel(address, self._credentials, options=options,
                                                  interceptors=self._interceptors)
            self._channels[address] = channel
        return ControlClient(channel)


def transfer_span(handle: KVHandle, traceparent: str) -> Span:
    """The receiver's `pdmesh.kv_transfer` span (CLIENT), parented on `traceparent`."""
    return get_tracer().start_span(
        "pdmesh.kv_transfer",
        context=context_from_traceparent(traceparent),
        kind=SpanKind.CLIENT,
        attributes={
            "pdmesh.kv.side": "receiver",
            "pdmesh.kv.transfer": log_id(handle.transfer_id),
            "pdmesh.request_id": handle.request_id,
            "pdmesh.kv.sender_address": handle.sender_address,
            "pdmesh.kv.num_blocks": handle.layout.num_blocks,
            "pdmesh.kv.num_tokens": handle.layout.num_tokens,
        },
    )
