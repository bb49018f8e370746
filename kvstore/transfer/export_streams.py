"""Streamed exports on the sender's control plane: what each growing export has made ready.

A prefill run with `PrefillStream` lends its blocks while the prompt is computed. Its engine
core reports, after each step, the blocks that became ready (`ExportProgress`); the prefill
service appends each report here (`append`), on the event loop, and a receiver that started
the transfer follows them with `WatchTransfer` (`watch`: every report so far, then each as it
comes). The log ends when the export is sealed (the prefill ended) or fails (the prefill was
preempted or aborted, the transfer was released): a watcher sees the failure, never a hang.

`StreamedExports` is the `KVSender`'s side of it: each growing export's log and its blocks as
the data planes serve them, grown together, sealed into the prefill's final handle, and ended
from any thread when the transfer is released.

Only numbers pass here (block ids, checksums); the bytes go core to core.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdmesh.kvstore.connector.export_info import ExportProgress
from pdmesh.kvstore.transfer.errors import KVTransferNotFound
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.worker_planes import Exports


@dataclass
class ExportStream:
    """One growing export: its reports so far and whether it ended."""

    block_ids: list[int] = field(default_factory=list)
    checksums: list[int] = field(default_factory=list)
    reports: list[ExportProgress] = field(default_factory=list)
    ended: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def sealed(self) -> bool:
        return bool(self.reports) and self.reports[-1].sealed


class ExportStreams:
    """The growing exports of one sender, by transfer id (event loop only)."""

    def __init__(self) -> None:
        self._streams: dict[str, ExportStream] = {}

    def open(self, transfer_id: str) -> None:
        self._streams[transfer_id] = ExportStream()

    def get(self, transfer_id: str) -> ExportStream | None:
        return self._streams.get(transfer_id)

    def append(self, transfer_id: str, progress: ExportProgress) -> ExportStream | None:
        """Record a report from the core; None if the stream ended (it is dropped)."""
        stream = self._streams.get(transfer_id)
        if stream is None or stream.ended:
            return None
        if progress.first_index != len(stream.checksums):
            progress = ExportProgress(len(stream.checksums),
                                      failed=f"progress out of order at block "
                                             f"{progress.first_index}")
        stream.block_ids += progress.block_ids
        stream.checksums += progress.block_checksums
        stream.reports.append(progress)
        stream.ended = progress.sealed or bool(progress.failed)
        stream.changed.set()
        return stream

    def end(self, transfer_id: str, why: str) -> None:
        """The transfer was released: a stream not sealed yet fails; forget it either way
        (watchers still hold it and see its last report)."""
        stream = self._streams.pop(transfer_id, None)
        if stream is not None and not stream.ended:
            stream.reports.append(ExportProgress(len(stream.checksums), failed=why))
            stream.ended = True
            stream.changed.set()

    async def watch(self, transfer_id: str) -> AsyncIterator[ExportProgress]:
        """Every report of the stream, the ones so far first, until its last one."""
        stream = self._streams.get(transfer_id)
        if stream is None:
            raise KVTransferNotFound("no streamed export for this transfer",
                                     transfer_id=transfer_id)
        sent = 0
        while True:
            while sent < len(stream.reports):
                sent += 1
                yield stream.reports[sent - 1]
            if stream.ended:
                return
            stream.changed.clear()
            await stream.changed.wait()


class StreamedExports:
    """A sender's growing exports (`KVSender.publish_stream`): each one's log and its blocks
    as the data planes serve them (`Exports`), grown together as the core reports."""

    def __init__(self, exports: Exports) -> None:
        self.log = ExportStreams()
        self._exports = exports
        self.loop: asyncio.AbstractEventLoop | None = None  # the sender's, once started

    def open(self, transfer_id: str) -> None:
        """A growing export with no block ready yet. Event loop only."""
        self._exports.add(transfer_id, ())
        self.log.open(transfer_id)

    def progress(self, handle: KVHandle, progress: ExportProgress) -> KVHandle | None:
        """The core made more of a streamed export ready (or sealed, or failed it). When
        sealed: the handle with every block checksum (the prefill's final answer; a receiver
        that did not stream may start the transfer with it). Event loop only."""
        stream = self.log.append(handle.transfer_id, progress)
        if stream is None:
            return None
        self._exports.extend(handle.transfer_id, progress.block_ids)
        if not stream.sealed:
            return None
        return dataclasses.replace(handle, block_checksums=tuple(stream.checksums),
                                   streamed=False)

    def end(self, transfer_id: str, why: str) -> None:
        """Fail a growing export's watchers (any thread: the log lives on the loop)."""
        loop = self.loop
        if loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self.log.end(transfer_id, why)
        else:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(self.log.end, transfer_id, why)
