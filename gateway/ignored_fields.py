"""The request fields the gateway ignored, reported rather than refused: vLLM accepts unknown
fields (clients send fields of newer API versions, or vLLM-only ones pdmesh does not act on),
so a typo would pass unnoticed. Each request's are logged once and named in its answer's
`X-Ignored-Fields` header. Which fields were ignored is the request models' business
(`RequestModel`, `ignored_fields` in gateway/schemas.py)."""

from __future__ import annotations

import logging

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdmesh.gateway.request_id import request_id_of

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "x-ignored-fields"
MAX_NAMED_IGNORED = 16
"""Ignored fields named in the header and the log line; a body with thousands of unknown keys
must not make a header no client accepts."""

_STATE_KEY = "ignored_fields"


def note_ignored_fields(request: Request, ignored: list[str]) -> None:
    """Log the fields a request's body had that the gateway ignores, and have the answer name
    them (`IgnoredFieldsMiddleware`)."""
    if not ignored:
        return
    # Client-chosen names: made printable ASCII (a header's and a log's), each one bounded.
    names = [ascii(name)[1:-1][:64] for name in ignored[:MAX_NAMED_IGNORED]]
    if len(ignored) > MAX_NAMED_IGNORED:
        names.append(f"({len(ignored) - MAX_NAMED_IGNORED} more)")
    listed = ", ".join(names)
    logger.warning("request_id=%s ignored unknown fields: %s", request_id_of(request), listed)
    request.scope.setdefault("state", {})[_STATE_KEY] = listed


class IgnoredFieldsMiddleware:
    """Adds X-Ignored-Fields to an answer whose request body had fields the gateway ignored
    (noted by `note_ignored_fields` while the body was read)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_naming_them(message: Message) -> None:
            if message["type"] == "http.response.start":
                ignored = scope.get("state", {}).get(_STATE_KEY)
                if ignored:
                    message["headers"] = [*message.get("headers", []),
                                          (IGNORED_FIELDS_HEADER.encode(), ignored.encode())]
            await send(message)

        await self.app(scope, receive, send_naming_them)
