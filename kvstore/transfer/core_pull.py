"""Transfers whose bytes this process's engine core pulls itself (the worker connector).

The control plane stays here: `begin` starts the transfer on the sender (StartTransfer: the
router's capability, the lease, a one-time grant) and keeps its lease alive with the
receiver's heartbeat; the core gets `Pull.params` and pulls the blocks it lacks straight into
its cache (kvstore/connector/); `finish` acks (the sender releases its blocks) with the bytes
pulled, or reports why the pull failed, and ends the transfer's span and metrics. Staged
transfers, whose bytes come here, are `KVReceiver.fetch`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from pdmesh.kvstore.transfer.capability import TransferCapability
from pdmesh.kvstore.transfer.control import ControlClient
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import (
    KVBackendUnavailable,
    KVTransferError,
    failure_outcome,
)
from pdmesh.kvstore.transfer.handle import KVHandle, log_id
from pdmesh.kvstore.transfer.receiver import KVReceiver, transfer_span
from pdmesh.tracing import Span, mark_error, span_traceparent

logger = logging.getLogger(__name__)


@dataclass
class Pull:
    """A transfer started for this receiver's engine core to pull itself (`begin`): the
    parameters its transport needs, and the lease heartbeat that runs until `finish`."""

    handle: KVHandle
    backend: str
    params: dict[str, str]
    control: ControlClient
    deadline: Deadline
    started: float
    span: Span
    traceparent: str
    heartbeat: asyncio.Task[None] | None = None
    ending: bool = False    # `finish` was asked for (it may still be running)
    finished: bool = False


class CorePulls:
    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver

    async def begin(
        self,
        handle: KVHandle,
        deadline: Deadline | float = 30.0,
        *,
        backend: str,
        traceparent: str = "",
        capability: TransferCapability | None = None,
        start_deadline: Deadline | None = None,
    ) -> Pull:
        """Start a transfer whose bytes this process's engine core pulls itself (an export:
        `handle.is_export`); the lease is kept alive until `finish` (or `deadline`). Raises
        like `fetch`. `start_deadline`: a tighter bound for StartTransfer itself (a streamed
        pull's lease outlives the fetch timeout, its start does not)."""
        started = time.monotonic()
        deadline = Deadline.coerce(deadline)
        span = transfer_span(handle, traceparent)
        span.set_attribute("pdmesh.kv.backend", backend)
        control = self.receiver.control(handle.sender_address)
        try:
            if backend not in handle.backends:
                raise KVBackendUnavailable(f"sender does not offer backend {backend!r}")
            proof = (self.receiver.host_proof(handle) or "") if backend == "shm" else ""
            reply = await control.start(
                handle, backend, proof, deadline.remaining() + self.receiver.config.lease_margin_s,
                start_deadline or deadline, span_traceparent(span), capability,
            )
        except BaseException as exc:
            outcome = failure_outcome(exc)
            self.receiver.metrics.observe("received", backend, 0, 0.0, outcome)
            span.set_attribute("pdmesh.kv.outcome", outcome)
            mark_error(span, exc)
            span.end()
            raise
        pull = Pull(handle, backend, dict(reply.params), control, deadline, started, span,
                    span_traceparent(span))
        pull.heartbeat = asyncio.ensure_future(self.receiver.heartbeat(control, handle, deadline))
        return pull

    async def finish(self, pull: Pull, *, nbytes: int = 0, error: str = "",
                     reason: str = "") -> None:
        """The core's pull ended: ack it (the sender releases the blocks) or report why it
        failed. Idempotent; never raises (a failed notice is logged)."""
        if pull.finished:
            return
        pull.ending = pull.finished = True
        if pull.heartbeat is not None:
            pull.heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError, KVTransferError):
                await pull.heartbeat
        outcome = reason or ("ok" if not error else "error")
        try:
            await pull.control.complete(pull.handle, not error, error[:1024],
                                        self.receiver.notice_deadline(), pull.traceparent,
                                        pulled_bytes=nbytes)
        except KVTransferError as exc:
            if not error:  # the blocks were pulled and checked: the lease ended meanwhile
                logger.debug("ack of %s failed: %s", log_id(pull.handle.transfer_id), exc)
        elapsed = time.monotonic() - pull.started
        self.receiver.metrics.observe("received", pull.backend, nbytes, elapsed, outcome)
        span = pull.span
        if span.is_recording():
            span.set_attributes({"pdmesh.kv.bytes": nbytes, "pdmesh.kv.outcome": outcome,
                                 "pdmesh.kv.duration_ms": elapsed * 1e3})
        if error:
            mark_error(span, error)
        span.end()

    def finish_soon(self, pull: Pull, *, nbytes: int = 0, error: str = "",
                    reason: str = "") -> None:
        """`finish` in the background (a first token need not wait for the ack)."""
        if not pull.ending:
            pull.ending = True
            self.receiver.notify(self.finish(pull, nbytes=nbytes, error=error, reason=reason))

    def abandon(self, pull: Pull, why: str) -> None:
        """Finish a pull from a callback or a `finally` (a task tracked until close)."""
        self.finish_soon(pull, error=why, reason="cancelled")
