"""A streamed answer (Server-Sent Events): the events of a request's router calls merged as they
arrive, each delta formatted by the request's `Formatter` into chunks of one choice each, then
the usage (stream_options.include_usage) or the error that ended the stream, then `[DONE]`.

The response only starts once every call produced its first event (`first_events`), so a
refusal is still a proper status and not a broken stream; what fails later can only be told
in the stream, as an `{"error": ...}` event. With `--sse-keep-alive-interval` the router is
asked to say when it accepted a call (`send_accepted`: validated and queued), which is then
its first event: the stream starts before the first token, and `with_keep_alive` sends an SSE
comment whenever the stream has been idle that long (queue waits, long prefills, gaps between
tokens), which proxies count as traffic and clients ignore. A failure after acceptance (a
deadline passed in the queue) is then an error event, as vLLM streams it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from pdmesh.gateway.disconnect import CLIENT_CLOSED
from pdmesh.gateway.errors import GatewayError, generation_failed
from pdmesh.gateway.formatter import Choice
from pdmesh.gateway.generation import Generation

END: Any = object()
"""A call's end, in `first_events` and the merged events."""

DONE = "data: [DONE]\n\n"
KEEP_ALIVE = ": keep-alive\n\n"
"""An SSE comment: bytes on the wire that every SSE client skips."""
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def is_comment(chunk: str | bytes) -> bool:
    return (chunk.decode() if isinstance(chunk, bytes) else chunk).startswith(":")


async def with_keep_alive(events: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """`events`, with a `KEEP_ALIVE` comment each time `interval_s` passes without one. The
    next event is awaited in a task of its own that a comment never interrupts; closing this
    stream closes `events`."""
    it = aiter(events)
    pending: asyncio.Future[str] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEP_ALIVE
                continue
            finished, pending = pending, None
            try:
                event = finished.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        close = getattr(it, "aclose", None)
        if close is not None:
            await close()


def sse_event(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def first_events(iterators: list[AsyncIterator[Any]]) -> list[Any]:
    """Each call's first event (END for a call that had none); a refusal raises."""
    return list(await asyncio.gather(*(anext(it, END) for it in iterators)))


def _chunk(gen: Generation, choices: list[Choice]) -> dict[str, Any]:
    usage = None
    if gen.continuous_usage:
        usage = {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.streamed_tokens,
                 "total_tokens": gen.prompt_tokens + gen.streamed_tokens}
    return {"id": gen.head.id, "object": gen.formatter.chunk_object,
            "created": gen.head.created, "model": gen.head.model, "choices": choices,
            "usage": usage}


async def _pump(queue: asyncio.Queue[tuple[int, Any]], p: int, first: Any,
                rest: AsyncIterator[Any]) -> None:
    """Call `p`'s events into the shared queue, then END or the error that ended it."""
    try:
        if first is not END:
            await queue.put((p, first))
            async for resp in rest:
                await queue.put((p, resp))
        await queue.put((p, END))
    except GatewayError as exc:
        await queue.put((p, exc))
    except asyncio.CancelledError:
        # The call was cancelled (client gone, or cleanup): nothing left to read.
        await queue.put((p, GatewayError(CLIENT_CLOSED, "cancelled")))


async def sse_events(
    gen: Generation, iterators: list[AsyncIterator[Any]], firsts: list[Any],
    done: Callable[[], None],
) -> AsyncIterator[str]:
    """The stream's SSE events; `done` is called when it ends, however it ends."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(queue, p, firsts[p], iterators[p]))
             for p in range(len(gen.calls))]
    formatter = gen.formatter
    error: GatewayError | None = None
    try:
        for choice in formatter.opening():
            yield sse_event(_chunk(gen, [choice]))
        started: set[int] = set()  # prompts whose first event arrived
        ended = 0
        while ended < len(pumps):
            p, item = await queue.get()
            if item is END:
                ended += 1
                continue
            if isinstance(item, GatewayError):
                error = item
                break
            if item.HasField("accepted"):
                continue
            if item.HasField("result"):
                gen.usage.add(item.result.usage)
                continue
            if p not in started:
                started.add(p)
                entries = list(item.prompt_logprobs.entries) \
                    if item.HasField("prompt_logprobs") else None
                for choice in formatter.prompt_started(p, entries):
                    yield sse_event(_chunk(gen, [choice]))
            if item.HasField("prompt_logprobs"):
                continue
            delta = item.delta
            gen.saw_delta(delta)
            gen.streamed_tokens += len(delta.token_ids)
            # A token whose text is held back (half a UTF-8 character, a possible stop
            # string) still gets its chunk, with empty text, as vLLM streams it: a client
            # timing chunks sees the engine's cadence, not a gap twice as long.
            if not (delta.token_ids or delta.text or delta.logprobs or delta.HasField("finish")):
                continue
            out = formatter.delta(p * gen.n + delta.index, delta)
            for choice in out.choices:
                yield sse_event(_chunk(gen, [choice]))
            if out.failed and error is None:
                error = generation_failed(delta.finish.message)
        if error is not None:
            yield sse_event(error.body())
        elif gen.include_usage:
            chunk = _chunk(gen, [])
            chunk["usage"] = gen.usage.model_dump(mode="json")
            yield sse_event(chunk)
        yield DONE
        gen.ok = error is None
    finally:
        for task in pumps:
            task.cancel()
        done()
