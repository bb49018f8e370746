"""The requests an `AsyncEngine` serves, one stream each, fed from the core's batches.

The core reports only new token ids per step; the output processor (text, stop strings,
logprobs) turns them into cumulative `RequestOutput`s here, on the event loop, and each goes
to its request's stream. The KV cache events that ride along the batches are kept for the
service's presence (`take_events`); a streamed export's progress goes to whoever watches it
(`watch_export`: the prefill service, which publishes it to the KV control plane).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

from pdmesh.engine.core_protocol import Batch, events_from_wire
from pdmesh.engine.core_types import CoreOutput
from pdmesh.engine.frontend.core_liveness import CoreLiveness
from pdmesh.engine.frontend.output_processor import OutputProcessor
from pdmesh.engine.kv_events import KVEvent
from pdmesh.engine.outputs import RequestOutput
from pdmesh.kvstore.connector.export_info import ExportProgress

ExportWatcher = Callable[[ExportProgress], None]


class RequestStream:
    """Outputs of one request, from the reply handler to its consumer (both on the loop).

    Newest wins: outputs are cumulative, so a consumer that fell behind (its gRPC stream
    blocked on a slow peer, or the step loop outpacing the per-token messaging) gets the
    latest output, holding everything the ones it missed did, at once: one message carrying
    several tokens instead of a backlog of one-token messages that only grows. An error is
    delivered after the output that was pending when it came."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        self._latest = out
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def next(self) -> RequestOutput:
        """The newest output not taken yet; raises the stream's error after the outputs."""
        await self._ready.wait()
        out, self._latest = self._latest, None
        if out is not None:
            if self._error is None:
                self._ready.clear()
            return out
        assert self._error is not None
        raise self._error


class RequestStreams:
    """Open streams by request id, the output processor behind them, and the KV events."""

    def __init__(self, processor: OutputProcessor, liveness: CoreLiveness) -> None:
        self.processor = processor
        self.liveness = liveness
        self.kv_events_ready = asyncio.Event()
        self._events: list[KVEvent] = []
        self._streams: dict[str, RequestStream] = {}
        self._export_watchers: dict[str, ExportWatcher] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._streams))

    def is_open(self, request_id: str, stream: RequestStream) -> bool:
        return self._streams.get(request_id) is stream

    def open(self, request_id: str, num_prefill_tokens: int) -> RequestStream:
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        self.liveness.unprefilled[request_id] = num_prefill_tokens
        return stream

    def watch_export(self, request_id: str, watcher: ExportWatcher | None) -> None:
        """Hand `request_id`'s streamed-export progress to `watcher` (None: stop)."""
        if watcher is None:
            self._export_watchers.pop(request_id, None)
        else:
            self._export_watchers[request_id] = watcher

    def drop(self, request_id: str) -> None:
        """A request the core never took: forget it without failing anyone."""
        self._streams.pop(request_id, None)
        self.liveness.unprefilled.pop(request_id, None)
        self.processor.abort(request_id)

    def end(self, request_id: str, error: BaseException) -> None:
        """Fail a request's stream (its consumer sees `error` after what was pending)."""
        self.liveness.unprefilled.pop(request_id, None)
        stream = self._streams.pop(request_id, None)
        self.processor.abort(request_id)
        if stream is not None:
            stream.fail(error)

    def end_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self.end(request_id, error)
        with contextlib.suppress(Exception):
            self.processor.requests.clear()

    def deliver(self, batch: Batch) -> list[tuple[str, list[int]]]:
        """A step's outputs to their streams; the stop strings found ((request, sample
        indices) the core must stop)."""
        outputs, stops = self.processor.process(self._take_progress(batch.outputs))
        for out in outputs:
            self.liveness.unprefilled.pop(out.request_id, None)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                self._streams.pop(out.request_id, None)
        if batch.events:
            self._events.extend(events_from_wire(batch.events))
            self.kv_events_ready.set()
        return stops

    def _take_progress(self, outputs: list[CoreOutput]) -> list[CoreOutput]:
        """Streamed-export progress to its watchers; the outputs that carry more than that."""
        if all(out.kv_stream is None for out in outputs):
            return outputs
        rest = []
        for out in outputs:
            progress = out.kv_stream
            if progress is not None:
                watcher = self._export_watchers.get(out.request_id)
                if progress.sealed or progress.failed:
                    self._export_watchers.pop(out.request_id, None)
                if watcher is not None:
                    watcher(progress)
                if out == CoreOutput(out.request_id, kv_stream=progress):
                    continue  # progress only (a preempted prefill's failure)
            rest.append(out)
        return rest

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def clear_events(self) -> None:
        """A snapshot supersedes what was not taken yet."""
        self._events = []
