"""HTTP request bodies read under a byte cap as they stream in, and memory handed back after
large ones.

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
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import logging
import time
from typing import Any

from starlette.types import Message, Receive

from pdmesh.gc_heap import freeze_startup_heap

logger = logging.getLogger(__name__)

LARGE_BODY_BYTES = 2**20
"""After a body this large, memory is worth handing back (`MemoryReleaser`)."""


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
