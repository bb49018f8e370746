"""A deadline for a request's head: slow clients (slowloris) cannot hold connections open.

uvicorn times out a connection only while it is idle between requests (`timeout_keep_alive`,
armed once a response completes). A client that connects and sends nothing, or sends its
request line and headers a byte at a time, is never timed out, so a few hundred such
connections hold the gateway's sockets and memory for as long as they like. uvicorn has no
setting for it, so this protocol adds one: from the moment a connection opens, and again when
each later request on it begins, its whole head (request line and headers) has to arrive within
`header_timeout_s`, or the connection is closed. Bodies and responses are not covered: the
app reads the body under its own cap (`gateway/body.py`), and a response may stream for long.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing connections whose request head is too slow."""

    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_head_timer()  # a later request on a kept-alive connection

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request's head is late while the one before it still responds:
            # never cut that response; look again later.
            self._arm_head_timer()
            return
        logger.debug("closing a connection whose request head took over %gs client=%s",
                     self.header_timeout_s, self.client)
        self.transport.close()


def header_timeout_protocol(timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class for uvicorn's `http=` setting, with this deadline."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                {"header_timeout_s": timeout_s})
