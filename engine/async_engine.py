"""`AsyncEngine`: one synchronous `LLMEngine` driven by a dedicated thread, used from asyncio.

The engine is not thread-safe, so exactly one thread touches it. Everything else (gRPC
handlers on the event loop) sends *commands* through a thread-safe queue; the thread blocks on
that queue whenever the engine has nothing to compute, so an idle service burns no CPU. After
each step the thread hands the outputs back to the loop with `call_soon_threadsafe`.

Lifetimes are tied to consumers: a stream whose consumer stops iterating (client cancelled)
aborts its request so its blocks are freed. If the engine raises, every request in flight is
failed with `EngineError` and aborted; nothing is left waiting for an output that will never
come.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from pdmesh.engine.kv_events import AllBlocksCleared, BlockStored, KVEvent
from pdmesh.engine.llm_engine import LLMEngine, RequestState
from pdmesh.engine.outputs import RequestOutput, TokenLogprobs
from pdmesh.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineError(RuntimeError):
    """The engine thread failed while serving this request (or is shut down)."""


@dataclass(frozen=True)
class EngineLoadSnapshot:
    """Load figures taken by the engine thread after every step; safe to read anywhere."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_pinned_blocks: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        if not self.num_total_blocks:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks


class _Stream:
    """Outputs of one request, crossing from the engine thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: str) -> None:
        self.loop = loop
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.added_at = 0.0  # engine thread: when the request entered the engine
        self.state: RequestState | None = None  # engine thread: the request it streams
        self.queue_s: float | None = None  # engine thread: added -> first scheduled

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class _Command:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any] | None
    loop: asyncio.AbstractEventLoop | None


_STOP = object()


def _snapshot_output(out: RequestOutput, queue_s: float | None = None) -> RequestOutput:
    """Copy the lists the engine keeps mutating, so the loop reads a consistent view;
    `queue_s` (time waiting to be scheduled) joins the engine's own metrics."""
    outputs = [
        replace(c, token_ids=list(c.token_ids),
                logprobs=list(c.logprobs) if c.logprobs is not None else None)
        for c in out.outputs
    ]
    prompt_lps = list(out.prompt_logprobs) if out.prompt_logprobs is not None else None
    metrics = dict(out.metrics)
    if queue_s is not None:
        metrics["queue_s"] = queue_s
    return replace(out, outputs=outputs, prompt_logprobs=prompt_lps, metrics=metrics)


class AsyncEngine:
    """asyncio facade over one `LLMEngine`; create it inside a running event loop."""

    def __init__(self, engine: LLMEngine, *, name: str = "engine") -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Command | object] = queue.SimpleQueue()
        self._events_lock = threading.Lock()
        self._events: list[KVEvent] = []
        self._loop = asyncio.get_running_loop()
        self.kv_events_ready = asyncio.Event()
        self._load = EngineLoadSnapshot()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._refresh_load()
        self._thread.start()

    # -- static facts (read-only after construction) ---------------------------------------------
    @property
    def block_size(self) -> int:
        return self.engine.config.block_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_total_blocks(self) -> int:
        return self.engine.num_total_blocks

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def load(self) -> EngineLoadSnapshot:
        return self._load

    def check_kv_capacity(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise `KVCacheFullError` for a request that can never fit this engine's KV pool.
        Safe on the event loop (it reads fixed figures only): lets a service refuse before it
        spends anything on the request, such as pulling its KV."""
        self.engine.check_kv_capacity(num_prompt_tokens, params)

    # -- requests --------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Colocated generation; yields cumulative outputs until one has `finished`."""

        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt, params, priority=priority,
                               cache_salt=cache_salt)

        async for out in self._stream(request_id, add):
            yield out

    async def prefill_export(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        """Prefill role: run the prompt, sample the first token(s), keep the KV pinned.

        The result has `kv_export` set; the caller must eventually `release_kv` (or `abort`).
        Cancelling the awaiting task aborts the request.
        """

        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt, params, priority=priority,
                               cache_salt=cache_salt, export_kv=True)

        last: RequestOutput | None = None
        async for out in self._stream(request_id, add):
            last = out
        if last is None or last.kv_export is None:
            raise EngineError(f"request {request_id!r} finished without exported KV")
        return last

    async def import_and_decode(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_ids: list[int],
        kv: torch.Tensor,
        params: SamplingParams,
        *,
        first_logprobs: list[TokenLogprobs | None] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        num_cached_tokens: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Decode role: continue from KV computed elsewhere. `KVCacheFullError` and validation
        errors surface from the first iteration, before any output."""

        def add(engine: LLMEngine) -> None:
            engine.add_imported_request(
                request_id, prompt_token_ids, first_token_ids, kv, params,
                first_logprobs=first_logprobs, priority=priority, cache_salt=cache_salt,
                num_cached_tokens=num_cached_tokens,
            )

        async for out in self._stream(request_id, add):
            yield out

    async def resume(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[list[int]],
        params: SamplingParams,
        *,
        output_logprobs: list[list[TokenLogprobs | None]] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Continue a request whose first output tokens (per sample) were produced elsewhere,
        recomputing its KV here (`LLMEngine.add_resumed_request`). Outputs carry the given
        tokens too; `KVCacheFullError` and validation errors surface from the first iteration,
        before any output."""

        def add(engine: LLMEngine) -> None:
            engine.add_resumed_request(
                request_id, prompt_token_ids, output_token_ids, params,
                output_logprobs=output_logprobs, priority=priority, cache_salt=cache_salt,
            )

        async for out in self._stream(request_id, add):
            yield out

    async def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free all its blocks; False if unknown."""
        return await self.call(lambda e: self._abort_in_thread(e, request_id))

    def abort_nowait(self, request_id: str) -> None:
        """Fire-and-forget abort, usable from `finally` blocks and callbacks."""
        self._submit(lambda e: self._abort_in_thread(e, request_id), None)

    async def read_kv(self, request_id: str) -> torch.Tensor:
        """A copy of an exported request's KV blocks."""
        return await self.call(lambda e: e.read_kv(request_id))

    async def release_kv(self, request_id: str) -> bool:
        return await self.call(lambda e: e.release_kv(request_id))

    def release_kv_nowait(self, request_id: str) -> None:
        self._submit(lambda e: e.release_kv(request_id), None)

    # -- KV events -------------------------------------------------------------------------------
    async def take_kv_events(self) -> list[KVEvent]:
        """Events since the previous call (or snapshot)."""
        with self._events_lock:
            events, self._events = self._events, []
        return events

    async def kv_snapshot(self) -> list[KVEvent]:
        """Everything cached right now as one batch; drops events it supersedes."""

        def snapshot(engine: LLMEngine) -> list[KVEvent]:
            engine.take_kv_events()
            with self._events_lock:
                self._events = []
            hashes = tuple(engine.kv_manager.pool.cached.keys())
            return [AllBlocksCleared(), BlockStored(hashes)] if hashes else [AllBlocksCleared()]

        return await self.call(snapshot)

    # -- plumbing --------------------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread and return its result (or raise its error)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._submit(fn, future)
        return await future

    async def shutdown(self) -> None:
        """Abort everything, stop the thread. Pending streams fail with EngineError."""
        if self._closed:
            return
        self._closed = True
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join, 30.0)

    def _submit(self, fn: Callable[[LLMEngine], Any], future: asyncio.Future[Any] | None) -> None:
        if self._closed:
            if future is not None:
                future.set_exception(EngineError("engine is shut down"))
            return
        loop = future.get_loop() if future is not None else None
        self._commands.put(_Command(fn, future, loop))

    async def _stream(
        self, request_id: str, add: Callable[[LLMEngine], None]
    ) -> AsyncIterator[RequestOutput]:
        stream = _Stream(asyncio.get_running_loop(), request_id)

        def start(engine: LLMEngine) -> None:
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already running")
            add(engine)
            stream.added_at = time.monotonic()
            stream.state = engine.requests.get(request_id)
            self._streams[request_id] = stream

        try:
            await self.call(start)
        except asyncio.CancelledError:
            # Cancelled while the engine thread may be adding the request: nobody will consume
            # it, so drop it (and its blocks) if it was added.
            self._submit(lambda e: self._abort_stream_in_thread(e, stream), None)
            raise
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                # The consumer left early (client cancel, error): free the request's blocks.
                self.abort_nowait(request_id)

    def _abort_stream_in_thread(self, engine: LLMEngine, stream: _Stream) -> None:
        """Abort the request `stream` added, but never a later one under the same id."""
        rid = stream.request_id
        if stream.state is not None and engine.requests.get(rid) is stream.state:
            self._abort_in_thread(engine, rid)

    def _abort_in_thread(self, engine: LLMEngine, request_id: str) -> bool:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put_threadsafe(EngineError(f"request {request_id!r} was aborted"))
        return engine.abort_request(request_id)

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        idle = True
        while True:
            try:
                item = self._commands.get(block=idle)
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    self._stop_in_thread()
                    return
                assert isinstance(item, _Command)
                self._execute(item)
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    item = None
            idle = not self._step()

    def _execute(self, cmd: _Command) -> None:
        try:
            result = cmd.fn(self.engine)
        except Exception as exc:  # handed to the caller, not fatal to the engine
            self._refresh_load()
            if cmd.future is None:
                logger.warning("engine command failed: %r", exc)
            else:
                self._resolve(cmd, None, exc)
            return
        self._refresh_load()  # callers that see the result also see its effect on the load
        if cmd.future is not None:
            self._resolve(cmd, result, None)

    @staticmethod
    def _resolve(cmd: _Command, result: Any, exc: BaseException | None) -> None:
        def settle() -> None:
            if cmd.future is None or cmd.future.done():
                return
            if exc is not None:
                cmd.future.set_exception(exc)
            else:
                cmd.future.set_result(result)

        assert cmd.loop is not None
        with contextlib.suppress(RuntimeError):
            cmd.loop.call_soon_threadsafe(settle)

    def _step(self) -> bool:
        """One engine step if there is work; True if it made progress (keep stepping)."""
        engine = self.engine
        if not engine.has_unfinished_requests() and not engine._pending_outputs:
            return False
        steps_before = engine.num_steps
        step_started = time.monotonic()
        try:
            outputs = engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing every request in flight")
            self._fail_all(exc)
            return False
        self._refresh_load()
        self._note_scheduled(step_started)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put_threadsafe(_snapshot_output(out, stream.queue_s))
            if out.finished:
                self._streams.pop(out.request_id, None)
        self._collect_events()
        # No step ran and nothing came out: waiting requests are blocked (e.g. on pinned KV).
        # Sleep on the command queue until something (a release, an abort) changes that.
        return engine.num_steps != steps_before or bool(outputs)

    def _note_scheduled(self, step_started: float) -> None:
        """Queue time of requests that left the waiting queue in the step just run."""
        unscheduled = [s for s in self._streams.values() if s.queue_s is None]
        if not unscheduled:
            return
        waiting = {seq.request_id for seq in self.engine.scheduler.waiting}
        for stream in unscheduled:
            if stream.request_id not in waiting:
                stream.queue_s = max(0.0, step_started - stream.added_at)

    def _fail_all(self, exc: BaseException) -> None:
        error = EngineError(f"engine step failed: {type(exc).__name__}: {exc}")
        for request_id, stream in list(self._streams.items()):
            stream.put_threadsafe(error)
            with contextlib.suppress(Exception):
                self.engine.abort_request(request_id)
        self._streams.clear()
        for request_id in list(self.engine.requests):
            with contextlib.suppress(Exception):
                self.engine.abort_request(request_id)
        self._collect_events()
        self._refresh_load()

    def _stop_in_thread(self) -> None:
        error = EngineError("engine is shutting down")
        for stream in self._streams.values():
            stream.put_threadsafe(error)
        self._streams.clear()
        for request_id in list(self.engine.requests):
            with contextlib.suppress(Exception):
                self.engine.abort_request(request_id)
        # Commands that raced with the stop must not hang their callers.
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Command) and item.future is not None:
                self._resolve(item, None, EngineError("engine is shut down"))
        self._collect_events()
        self._refresh_load()

    def _collect_events(self) -> None:
        events = self.engine.take_kv_events()
        if not events:
            return
        with self._events_lock:
            self._events.extend(events)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.kv_events_ready.set)

    def _refresh_load(self) -> None:
        engine = self.engine
        pinned = sum(
            len(s.kv_export.block_ids) for s in engine.requests.values()
            if s.kv_export is not None
        )
        stats = engine.kv_manager.stats
        self._load = EngineLoadSnapshot(
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            num_free_blocks=engine.num_free_blocks,
            num_total_blocks=engine.num_total_blocks,
            num_pinned_blocks=pinned,
            prefix_hit_tokens=stats.hits,
            prefix_query_tokens=stats.queries,
        )
