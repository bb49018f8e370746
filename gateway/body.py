"""HTTP request bodies read under a byte cap as they stream in, parsed as JSON objects with a
precise 400 for each way a body can be unreadable, and memory handed back after large ones.

A `Content-Length` header can be checked before reading, but a chunked body announces no
size: the only way to hold a cap on it is to count the bytes as they arrive and stop reading
at the first one over. `read_body` does that for every framing (it sees ASGI messages, after
the server has undone the framing), so a 20 MB chunked upload costs at most the cap.

Memory after large bodies: a large request leaves two kinds of memory behind. Objects in
reference cycles (a failed request's exception traceback holds the frames that hold its body,
its parsed JSON and its protobuf) wait for a full garbage collection, which a few big objects
never trigger (collections count allocations, not bytes). And glibc keeps the heap it grew (its
free lists keep the pages, and freeing a big mmapped block raises its mmap threshold, so later
big blocks land in the heap too). `MemoryReleaser` runs, shortly after a large body, a full
collection and then `malloc_trim`, so the RSS returns near its baseline instead of staying at
its high-water mark. It freezes the objects alive when it is created (at start-up: modules,
the app) out of the collector's way first, so that collection costs well under a millisecond
instead of scanning every imported module (~50 ms on a small machine).

JSON bodies (`parse_json_object`): like vLLM, the API takes `Content-Type: application/json`
only (any other, or none, is a 400 naming the header: a client sending form data or plain text
learns that at once instead of from a confusing field error). The body is parsed by
pydantic-core's parser, which bounds nesting (`JSON_MAX_DEPTH`), so a 10k-deep body cannot
exhaust the stack of the parser or of anything walking the result later, and refuses text no
protobuf string can carry (invalid UTF-8, lone UTF-16 surrogates). Only a refused body is looked
at again (with the standard library's parser) to say exactly what is wrong and where.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import json
import logging
import re
import time
from typing import Any

from pydantic_core import from_json
from starlette.types import Message, Receive

from pdmesh.gc_heap import freeze_startup_heap

logger = logging.getLogger(__name__)

LARGE_BODY_BYTES = 2**20
"""After a body this large, memory is worth handing back (`MemoryReleaser`)."""

JSON_MEDIA_TYPE = "application/json"
JSON_MAX_DEPTH = 200
"""How deep arrays and objects may nest in a body: pydantic-core's parser's fixed limit, far
beyond any real request (a JSON schema nests a few levels)."""


class BodyTooLarge(Exception):
    """More than the cap arrived; the rest of the body was not read."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body over {limit} bytes")
        self.limit = limit


class ClientGone(Exception):
    """The client disconnected before its body was complete."""


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body, reading no further than `limit` + one message."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            chunks.clear()  # the traceback keeps this frame alive a while
            raise BodyTooLarge(limit)
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class BadBody(ValueError):
    """A body that is not a readable JSON object; `param` names the header or field at fault,
    when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def parse_json_object(body: bytes, content_type: str | None) -> dict[str, Any]:
    """The body as a JSON object; `BadBody` says what is wrong (see the module docstring)."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise BadBody(f"Unsupported Media Type: Only '{JSON_MEDIA_TYPE}' is allowed, got {got}",
                      param="Content-Type")
    if not body.strip():
        raise BadBody("the body is empty; expected a JSON object")
    try:
        data = from_json(body)
    except ValueError as exc:
        raise _why_unparsable(body, str(exc)) from None
    if not isinstance(data, dict):
        raise BadBody(f"the body must be a JSON object, got {_json_kind(data)}")
    return data


def _why_unparsable(body: bytes, parser_message: str) -> BadBody:
    """What is wrong with a body pydantic-core refused, in words naming the place."""
    nesting = BadBody(f"the body nests arrays and objects deeper than {JSON_MAX_DEPTH} levels")
    if parser_message.startswith("recursion limit exceeded"):
        return nesting
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BadBody(f"the body is not valid UTF-8: byte 0x{body[exc.start]:02x} at offset "
                       f"{exc.start} ({exc.reason})")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return BadBody(f"the body is not valid JSON: {exc}")
    except RecursionError:
        return nesting
    found = _lone_surrogate(data)
    if found is not None:
        where, param, char = found
        return BadBody(f"{where}: lone UTF-16 surrogate \\u{ord(char):04x} is not valid Unicode "
                       "(a surrogate escape must be half of a pair)", param=param)
    return BadBody(f"the body is not valid JSON: {parser_message}")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(data: Any) -> tuple[str, str | None, str] | None:
    """Where the first lone surrogate is (in words, and as a field path), and which it is:
    ("messages[0].content", "messages[0].content", "\\ud800"). json.loads joins valid pairs,
    so any surrogate left is lone. The answer never holds the surrogate itself: it cannot be
    encoded as UTF-8."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            match = _SURROGATE.search(value)
            if match is not None:
                return path or "the body", path or None, match.group()
        elif isinstance(value, dict):
            for key in value:
                match = _SURROGATE.search(key)
                if match is not None:
                    return f"a key of {path or 'the body'}", path or None, match.group()
            stack.extend((f"{path}.{key}" if path else key, item)
                         for key, item in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


def _json_kind(value: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive channel that yields `body` as one message, then the real channel's messages
    (so the app still sees `http.disconnect`). It lets go of `body` once it has been read."""
    pending: list[bytes] = [body]

    async def receive_replayed() -> Message:
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        return await receive()

    return receive_replayed


@functools.cache
def _malloc_trim() -> Any:
    path = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(path).malloc_trim if path else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        trim = None
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
    return trim


def release_memory() -> bool:
    """Collect cyclic garbage and return the allocator's free heap pages to the OS; False
    where the allocator cannot (not glibc)."""
    gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class MemoryReleaser:
    """Runs `release_memory` `delay_s` after it is asked to (once for any number of asks in
    between), so that what a finished request leaves behind (its cancelled tasks unwind on the
    next loop turns) is garbage by then."""

    def __init__(self, delay_s: float = 0.1) -> None:
        self.delay_s = delay_s
        self._pending: asyncio.TimerHandle | None = None
        freeze_startup_heap()  # start-up objects live for good: collections skip them

    def soon(self) -> None:
        if self._pending is None:
            self._pending = asyncio.get_running_loop().call_later(self.delay_s, self._release)

    def _release(self) -> None:
        self._pending = None
        started = time.perf_counter()
        trimmed = release_memory()
        logger.debug("released memory trimmed=%s ms=%.1f", trimmed,
                     (time.perf_counter() - started) * 1e3)
