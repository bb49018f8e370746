"""A streamed export's progress on the sender's control plane (kvstore/transfer/export_streams.py)
and the handle of a growing export (issue 23, "Streamed by chunk")."""

from __future__ import annotations

import asyncio

import pytest

from pdmesh.kvstore.connector.export_info import ExportProgress
from pdmesh.kvstore.transfer.checksum import ChecksumAlgo
from pdmesh.kvstore.transfer.errors import KVHandleError, KVTransferNotFound
from pdmesh.kvstore.transfer.export_streams import ExportStreams
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.layout import KVLayout

pytestmark = pytest.mark.fast

TID = "a" * 32


def collect(streams: ExportStreams, transfer_id: str) -> asyncio.Task[list[ExportProgress]]:
    async def run() -> list[ExportProgress]:
        return [p async for p in streams.watch(transfer_id)]

    return asyncio.ensure_future(run())


def test_a_watcher_gets_the_reports_so_far_then_each_until_the_seal() -> None:
    async def main() -> None:
        streams = ExportStreams()
        streams.open(TID)
        streams.append(TID, ExportProgress(0, [7, 3], [11, 12], "xxh64"))
        watcher = collect(streams, TID)
        await asyncio.sleep(0)  # it has the first report and waits for the next
        assert not watcher.done()
        streams.append(TID, ExportProgress(2, [9], [13], "xxh64"))
        streams.append(TID, ExportProgress(3, [5], [14], "xxh64", sealed=True))
        reports = await asyncio.wait_for(watcher, 5)
        assert [p.block_ids for p in reports] == [[7, 3], [9], [5]]
        assert reports[-1].sealed
        stream = streams.get(TID)
        assert stream is not None and stream.checksums == [11, 12, 13, 14]
        assert streams.append(TID, ExportProgress(4, [1], [1])) is None  # ended: dropped

    asyncio.run(main())


def test_a_released_transfer_fails_its_watchers_instead_of_leaving_them_waiting() -> None:
    async def main() -> None:
        streams = ExportStreams()
        streams.open(TID)
        streams.append(TID, ExportProgress(0, [4], [1], "xxh64"))
        watchers = [collect(streams, TID), collect(streams, TID)]
        await asyncio.sleep(0)
        streams.end(TID, "transfer ended: cancelled")
        for watcher in watchers:
            reports = await asyncio.wait_for(watcher, 5)
            assert reports[-1].failed == "transfer ended: cancelled"
            assert reports[-1].first_index == 1
        with pytest.raises(KVTransferNotFound):
            await anext(streams.watch(TID))  # forgotten once released

    asyncio.run(main())


def test_a_report_out_of_order_fails_the_stream() -> None:
    streams = ExportStreams()
    streams.open(TID)
    stream = streams.append(TID, ExportProgress(2, [4], [1], "xxh64"))
    assert stream is not None and stream.ended and "out of order" in stream.reports[-1].failed


def handle(**changes: object) -> KVHandle:
    fields: dict[str, object] = dict(
        transfer_id=TID, request_id="r1", sender_address="127.0.0.1:5000", backends=("shm",),
        host_key="", sender_id="s", layout=KVLayout(2, 4, 16, 2, 8, "float32", 60),
        checksum_algo=ChecksumAlgo.LIN64, checksum=0)
    fields.update(changes)
    return KVHandle(**fields)  # type: ignore[arg-type]


def test_a_growing_export_handle_names_some_block_checksums_and_round_trips() -> None:
    growing = handle(streamed=True, block_checksums=(1, 2))
    assert growing.is_export
    assert KVHandle.from_proto(growing.to_proto()) == growing
    assert KVHandle.from_dict(growing.to_dict()) == growing
    assert handle(streamed=True).is_export  # none ready yet: still an export
    with pytest.raises(KVHandleError):  # more checksums than blocks
        handle(streamed=True, block_checksums=(1, 2, 3, 4, 5))
    with pytest.raises(KVHandleError):  # a sealed export names every block
        handle(block_checksums=(1, 2))
