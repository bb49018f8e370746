"""A Decode call whose prefill is still running (`RemotePrefill.streamed`, issue 23).

The router starts Decode as soon as the prefill published its growing export. This instance
starts the transfer at once (`remote_kv.py`), then two things run beside the call's output
loop, each only once the engine took the request (`added`):

* `follow`: the sender's progress (KVTransfer.WatchTransfer) goes to our core batch by batch
  (`AsyncEngine.kv_stream`), so it pulls each chunk's blocks while the next one computes; a
  broken stream (the prefill instance died) is a failed export for the core, which then
  frees the blocks and recomputes the prompt once the first tokens come;
* `first_tokens`: the prefill's first tokens, from `Decode.PrefillDone` (the router sends
  them when its PrefillStream ended), to the output builder and the core, which decodes once
  they are there and the KV has landed.

If the first tokens never come, the router cancelled the call: the call's own cleanup aborts
the request, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from pdmesh.engine.frontend.async_engine import AsyncEngine, EngineError
from pdmesh.engine.outputs import TokenLogprobs
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine_svc.codec import DeltaBuilder, logprob_from_proto
from pdmesh.kvstore.connector.export_info import ExportProgress
from pdmesh.kvstore.transfer.core_pull import Pull
from pdmesh.kvstore.transfer.errors import KVTransferError, KVTransferTimeout
from pdmesh.v1 import engine_pb2

logger = logging.getLogger(__name__)


@dataclass
class StreamedPrefill:
    """One streamed Decode call's follow-up: its first tokens when they come, and its tasks."""

    request_id: str
    params: SamplingParams
    builder: DeltaBuilder
    first: asyncio.Future[engine_pb2.RemotePrefill] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    idle_s: float = 30.0
    """The longest wait for the sender's next report (a stopped prefill instance answers
    nothing: its export is then failed here, as a pull that timed out)."""

    @property
    def remote(self) -> engine_pb2.RemotePrefill | None:
        """The prefill's RemotePrefill once PrefillDone gave it (its cached count)."""
        if self.first.done() and not self.first.cancelled():
            return self.first.result()
        return None

    def start(self, engine: AsyncEngine, pull: Pull, added: asyncio.Event) -> None:
        self.tasks = [
            asyncio.ensure_future(follow(engine, self.request_id, pull, added, self.idle_s)),
            asyncio.ensure_future(self._first_tokens(engine, added)),
        ]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if not self.first.done():
            self.first.cancel()

    def check_first(self, remote: engine_pb2.RemotePrefill) -> str | None:
        """Why these first tokens cannot continue this call; None when they can."""
        first = sorted(remote.first, key=lambda d: d.index)
        if [d.index for d in first] != list(range(self.params.n)) or any(
                len(d.token_ids) != 1 for d in first):
            return f"remote_prefill.first: expected one token for each of {self.params.n} " \
                   "sequences"
        return None

    async def _first_tokens(self, engine: AsyncEngine, added: asyncio.Event) -> None:
        remote = await self.first
        await added.wait()
        first = sorted(remote.first, key=lambda d: d.index)
        for d in first:
            self.builder.seed(d.index, len(d.token_ids), d.text, done=d.HasField("finish"))
        logprobs: list[list[TokenLogprobs | None]] | None = None
        if self.params.logprobs is not None:
            logprobs = [[logprob_from_proto(d.logprobs[0]) if d.logprobs else None]
                        for d in first]
        try:
            await engine.kv_stream_first_tokens(
                self.request_id, [[d.token_ids[0]] for d in first], logprobs)
        except (ValueError, EngineError) as exc:  # the call's output loop sees the abort
            logger.warning("request_id=%s: its first tokens were refused: %s",
                           self.request_id, exc)
            engine.abort_nowait(self.request_id)


class StreamedCalls:
    """The streamed Decode calls waiting for their first tokens, by request id; and first
    tokens that came before their call was registered (the two RPCs race), kept a while."""

    EARLY_LIMIT = 1024

    def __init__(self) -> None:
        self._calls: dict[str, StreamedPrefill] = {}
        self._early: dict[str, engine_pb2.RemotePrefill] = {}

    def register(self, call: StreamedPrefill) -> None:
        self._calls[call.request_id] = call
        early = self._early.pop(call.request_id, None)
        if early is not None and call.check_first(early) is None:
            call.first.set_result(early)

    def unregister(self, call: StreamedPrefill) -> None:
        if self._calls.get(call.request_id) is call:
            del self._calls[call.request_id]

    def give(self, request_id: str, remote: engine_pb2.RemotePrefill) -> str | None:
        """Hand a call its first tokens (or keep them for a call still to come); why they
        are refused, or None."""
        call = self._calls.get(request_id)
        if call is None:
            if len(self._early) >= self.EARLY_LIMIT:
                self._early.pop(next(iter(self._early)))
            self._early[request_id] = remote
            return None
        if call.first.done():
            return "remote_prefill: this call was given its first tokens already"
        problem = call.check_first(remote)
        if problem is None:
            call.first.set_result(remote)
        return problem


async def follow(engine: AsyncEngine, request_id: str, pull: Pull, added: asyncio.Event,
                 idle_s: float) -> None:
    """The sender's progress to our core until the seal (within the pull's deadline, the
    Decode call's, and `idle_s` between two reports); a broken or silent stream fails the
    export."""
    await added.wait()
    reports = pull.control.watch(pull.handle, pull.deadline, pull.traceparent)
    try:
        while True:
            try:
                progress = await asyncio.wait_for(anext(reports), idle_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise KVTransferTimeout(f"no progress from the sender for {idle_s:g}s",
                                        transfer_id=pull.handle.transfer_id) from None
            if not await engine.kv_stream(request_id, progress):
                return  # the request no longer waits (aborted, or already failed)
    except KVTransferError as exc:
        logger.info("request_id=%s: the streamed export broke: %s", request_id, exc)
        with contextlib.suppress(EngineError):
            await engine.kv_stream(request_id, ExportProgress(
                failed=f"{type(exc).__name__}: {exc}"))
    except EngineError:
        return  # our core is gone: the call fails with it
    finally:
        await reports.aclose()
