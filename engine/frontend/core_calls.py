"""Commands to an engine core and the answers to them, for `AsyncEngine` (on its event loop).

A command is either sent (fire-and-forget: abort, stop strings, release) or called: the call
gets an id, and the core's `Result` with that id settles its future — with a value, a raw
tensor frame (staged KV), KV events, or an error kind mapped back to its exception. Every
command counts as owed to the core's liveness (engine/frontend/core_liveness.py) until the core next
answers. Once closed (shut down, or the core died) nothing more is sent and calls fail at once.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Any

from pdmesh.engine.core_protocol import Call, Command, Result, events_from_wire
from pdmesh.engine.engine_request import KVCacheFullError
from pdmesh.engine.frontend.core_liveness import CoreLiveness

if TYPE_CHECKING:
    import torch


class EngineError(RuntimeError):
    """The engine failed while serving this request (or is shut down, or its core died)."""


ERRORS: dict[str, type[Exception]] = {
    "value": ValueError, "kv_full": KVCacheFullError, "key": KeyError, "engine": EngineError,
}
"""A `Result`'s error kind → the exception its caller gets."""


class CoreCalls:
    """The command side of a link to an engine core (`ProcessCoreLink`, `ThreadCoreLink`)."""

    def __init__(self, link: Any, liveness: CoreLiveness) -> None:
        self.link = link
        self.liveness = liveness
        self.closed = False  # no new work: shut down, or the core died
        self.dead_reason: str | None = None
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        """Calls waiting for their answer."""
        return len(self._calls)

    def send(self, command: Command) -> None:
        if not self.closed:
            self.liveness.owe()
            self.link.send(Call(0, command))

    async def call(self, command: Command, tensor: torch.Tensor | None = None) -> Any:
        """Send `command` (with a raw tensor frame, if any) and wait for its answer."""
        if self.closed:
            raise EngineError(self.dead_reason or "engine is shut down")
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.liveness.owe()
        self._calls[call_id] = future
        self.link.send(Call(call_id, command), tensor)
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    def settle(self, result: Result, tensor: torch.Tensor | None) -> None:
        """The core answered a call (one nobody waits for any more is dropped)."""
        future = self._calls.get(result.call_id)
        if future is None or future.done():
            return
        if result.error_kind is not None:
            future.set_exception(ERRORS.get(result.error_kind, EngineError)(result.error))
        elif tensor is not None:
            future.set_result(tensor)
        elif result.events is not None:
            future.set_result(events_from_wire(result.events))
        else:
            future.set_result(result.value)

    def fail_all(self, error: EngineError) -> None:
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
