"""What a KV sender offered, as observed: each published KV's size and, once a receiver
starts pulling it, the pull's span and timing; at its release one observation in the
`pdmesh:kv_transfer*` metrics (direction="sent") and the span's end.

Each pull is one `pdmesh.kv_transfer` span (kind SERVER) from StartTransfer to release,
parented on the receiver's span through the control message's `traceparent`. Spans carry the
transfer's `log_id`, never its id (a bearer secret). Thread-safe: offers come from the engine's
threads, starts and acks from the control plane's loop, releases from any thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from pdmesh.kvstore.transfer.handle import log_id
from pdmesh.kvstore.transfer.state import ReleaseReason
from pdmesh.metrics import KVTransferMetrics
from pdmesh.tracing import Span, SpanKind, context_from_traceparent, get_tracer, mark_error
from pdmesh.v1 import kv_transfer_pb2 as pb


@dataclass
class Served:
    """One published KV, as observed: what it weighs, and its pull once started."""

    transfer_id: str
    nbytes: int
    backend: str = ""
    started: float | None = None
    span: Span | None = None


class SentTransfers:
    def __init__(self, metrics: KVTransferMetrics) -> None:
        self._metrics = metrics
        self._served: dict[str, Served] = {}  # by request id; guarded by _lock
        self._lock = threading.Lock()

    def offered(self, request_id: str, transfer_id: str, nbytes: int) -> None:
        with self._lock:
            self._served[request_id] = Served(transfer_id, nbytes)

    def started(self, request: pb.StartTransferRequest) -> None:
        """A receiver was admitted to pull: the span and the clock start (once)."""
        with self._lock:
            served = self._served.get(request.request_id)
            if served is None or served.transfer_id != request.transfer_id or served.started:
                return
            served.backend = request.backend
            served.started = time.monotonic()
            served.span = get_tracer().start_span(
                "pdmesh.kv_transfer",
                context=context_from_traceparent(request.traceparent),
                kind=SpanKind.SERVER,
                attributes={
                    "pdmesh.kv.side": "sender",
                    "pdmesh.kv.backend": request.backend,
                    "pdmesh.kv.transfer": log_id(request.transfer_id),
                    "pdmesh.request_id": request.request_id,
                    "pdmesh.kv.bytes": served.nbytes,
                },
            )

    def completed(self, request: pb.CompleteTransferRequest) -> None:
        """A receiver's ack names the bytes it pulled (an export's receiver pulls only what
        its prefix cache lacks): count those, never more than was offered."""
        if not request.ok or not request.pulled_bytes:
            return
        with self._lock:
            served = self._served.get(request.request_id)
            if served is not None and served.transfer_id == request.transfer_id:
                served.nbytes = min(served.nbytes, request.pulled_bytes)

    def is_started(self, request_id: str, transfer_id: str) -> bool:
        """Whether that transfer of `request_id` is offered and a receiver started it."""
        with self._lock:
            served = self._served.get(request_id)
        return served is not None and served.transfer_id == transfer_id and bool(served.started)

    def pop(self, request_id: str) -> Served | None:
        """The released transfer's record (None: nothing was offered under that id)."""
        with self._lock:
            return self._served.pop(request_id, None)

    def observe(self, served: Served, reason: ReleaseReason) -> None:
        """A released transfer counted, and its span ended with its outcome."""
        outcome = "ok" if reason is ReleaseReason.ACKED else reason.name.lower()
        elapsed = time.monotonic() - served.started if served.started is not None else 0.0
        self._metrics.observe("sent", served.backend or "none", served.nbytes, elapsed, outcome)
        span = served.span
        if span is not None:
            span.set_attribute("pdmesh.kv.outcome", outcome)
            span.set_attribute("pdmesh.kv.duration_ms", elapsed * 1e3)
            if outcome != "ok":
                mark_error(span, f"transfer ended: {outcome}")
            span.end()
