"""A PrefillStream call: the KV lent while the prompt is computed (chunked prefill).

Its first message is the handle of the growing export (`KVSender.publish_stream`), published
when the engine core starts computing the prompt (its announcement, sent before the step that
runs the first chunk: `KVExports.announce_scheduled`), so the router's Decode call,
StartTransfer and WatchTransfer overlap that chunk instead of following it; not when the
request arrives: a prompt queued behind others holds no lease, no blocks and no Decode call on
the decode instance while it waits (a 2k-token prompt can wait tens of seconds on a busy
prefill instance, which a decode instance would otherwise count as a stalled pull). Then the
engine's progress (`AsyncEngine.prefill_export(on_kv_progress=...)`) goes to the sender's log,
which the decode instance follows (WatchTransfer); the last message is the usual response,
with the sealed handle. A preempted prefill fails its export: the request is aborted and the
call ends with ABORTED, so the router re-plans it.

The export's blocks are released exactly once, as `Prefill`'s are (the servicer's
`on_release`), or here when its transfer already ended (nothing to continue, or the transfer
released or expired before the seal) or the call ended before its response. The decode side
of the same stream is decode_svc/streamed.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from pdmesh.engine_svc.export_layout import export_layout
from pdmesh.kvstore.connector.export_info import ExportProgress
from pdmesh.kvstore.transfer.checksum import parse_algo
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.tracing import Span
from pdmesh.v1 import engine_pb2

if TYPE_CHECKING:
    from pdmesh.prefill_svc.servicer import PrefillServicer


def _retrieve(task: asyncio.Future[object]) -> None:
    """Mark a cancelled run's outcome as seen (nobody awaits it any more)."""
    if not task.cancelled():
        task.exception()


async def prefill_stream(
    servicer: PrefillServicer, request: engine_pb2.PrefillRequest,
    context: grpc.aio.ServicerContext, received: float, span: Span,
) -> AsyncIterator[engine_pb2.PrefillProgress]:
    """`PrefillServicer.PrefillStream`'s messages: the growing export's handle, published
    when the core starts the prompt (or with its first ready blocks), then the response
    (module docstring)."""
    rid = request.request_id
    params = await servicer.checked(request, context, span)
    sender = servicer.sender
    info = servicer.engine.info
    if sender is None or sender.core is None or not info.kv_checksum_algo:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            "this instance's engine core does not lend its KV: use Prefill")
    assert sender is not None
    prompt = list(request.prompt_token_ids)
    layout = export_layout(info, -(-len(prompt) // info.block_size), len(prompt))
    algo = parse_algo(info.kv_checksum_algo)
    published: list[KVHandle] = []
    first_blocks = asyncio.Event()
    sealed: list[KVHandle] = []
    failed: list[str] = []

    def handle() -> KVHandle:
        """The export's handle, published (its lease starting) on first use."""
        if not published:
            published.append(sender.publish_stream(rid, layout, algo))
            servicer.remember_published(rid, published[0].transfer_id, layout.nbytes)
        return published[0]

    def on_progress(progress: ExportProgress) -> None:
        if progress.failed:  # its blocks are gone: stop it now, the router re-plans
            failed.append(progress.failed)
            servicer.engine.abort_nowait(rid)
        final = sender.stream_progress(handle(), progress)
        first_blocks.set()
        if final is not None:
            sealed.append(final)

    done = False
    run = asyncio.ensure_future(servicer.run_export(request, params, context, span,
                                                    on_progress, failed))
    first = asyncio.ensure_future(first_blocks.wait())
    try:
        await asyncio.wait((run, first), return_when=asyncio.FIRST_COMPLETED)
        if not run.done() or (not run.cancelled() and run.exception() is None):
            yield engine_pb2.PrefillProgress(kv=handle().to_proto())
        out = await run
        response = servicer.response(rid, prompt, params, out, received)
        if not sealed or all(d.HasField("finish") for d in response.first):
            # Nothing to continue, or the transfer ended before the seal (released,
            # expired): nothing holds the export now.
            servicer.cancel_transfer(rid, "nothing to continue")
            await servicer.engine.release_kv(rid)
        else:
            response.kv.CopyFrom(sealed[0].to_proto())
        response.timing.e2e_ms = (time.monotonic() - received) * 1e3
        servicer.observe(span, rid, prompt, out, response, received)
        done = True
        yield engine_pb2.PrefillProgress(done=response)
    finally:
        first.cancel()
        if not run.done():  # the call was cancelled: so is the prefill (run_export aborts it)
            run.cancel()
            run.add_done_callback(_retrieve)
        if not done:  # cancelled, failed: the transfer ends (its release frees the KV)
            servicer.cancel_transfer(rid, "prefill stream ended before its response")
            servicer.engine.release_kv_nowait(rid)
