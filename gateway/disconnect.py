"""Noticing that the HTTP client went away, so its router calls are cancelled (which makes the
router abort the request on every instance and free its KV blocks)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request

from pdmesh.gateway.errors import GatewayError

T = TypeVar("T")

CLIENT_CLOSED = 499  # nginx's convention; only ever seen in logs and metrics


class DisconnectWatch:
    """Calls `on_disconnect` once if the HTTP client goes away before `stop()`.

    It waits on the ASGI receive channel, which yields `http.disconnect` when the client closes
    the connection (and also once the response is complete, hence `stop()` first).
    """

    def __init__(self, request: Request, on_disconnect: Callable[[], None]) -> None:
        self.fired = False
        self._request = request
        self._on_disconnect = on_disconnect
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self._request.receive())["type"] != "http.disconnect":
            pass
        self.fired = True
        self._on_disconnect()

    def stop(self) -> None:
        self._task.cancel()


async def until_disconnect(watch: DisconnectWatch, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the client left first (the calls are cancelled, so
    `work` fails; that failure is nobody's to hear)."""
    try:
        return await work
    except asyncio.CancelledError:
        if watch.fired:
            return None
        raise
    except GatewayError as exc:
        if watch.fired:
            return None
        raise exc from None
