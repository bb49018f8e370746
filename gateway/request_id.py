"""X-Request-Id in and out, as vLLM does: the client's id (or a new one) becomes the router's
request id, so it names the request in every service's logs and traces, and is sent back on
the response. Without the header, a body's `request_id` (vLLM's field) names it."""

from __future__ import annotations

import uuid

from fastapi import Request
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdmesh.gateway.errors import GatewayError, error_response

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_BYTES = 128  # the router's limit (router/server.py)


def check_request_id(request_id: str) -> str:
    """An id the router takes: printable ASCII, 1 to `MAX_REQUEST_ID_BYTES` bytes."""
    if (not request_id or not request_id.isascii() or not request_id.isprintable()
            or len(request_id) > MAX_REQUEST_ID_BYTES):
        raise ValueError(f"must be printable ASCII and at most {MAX_REQUEST_ID_BYTES} bytes")
    return request_id


def request_id_of(request: Request, body_id: str | None = None) -> str:
    """The request's id: the client's X-Request-Id, else the body's `request_id` (checked by
    its model), else the one made up for it (`RequestIdMiddleware`)."""
    state = request.scope.get("state", {})
    if body_id and not state.get("request_id_given"):
        return body_id
    return str(state.get("request_id") or uuid.uuid4().hex)


class RequestIdMiddleware:
    """Notes the request's id in the scope's state and sends it back on every answer. An id
    the router would refuse (too long, not printable) is a 400 here, naming the header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(REQUEST_ID_HEADER)
        request_id = given.strip() if given else uuid.uuid4().hex
        header = (REQUEST_ID_HEADER.encode(), request_id.encode("latin-1", "replace"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        try:
            check_request_id(request_id)
        except ValueError:
            refusal = error_response(GatewayError(
                400, f"X-Request-Id must be printable ASCII and at most {MAX_REQUEST_ID_BYTES} "
                "bytes", param="X-Request-Id"))
            header = (REQUEST_ID_HEADER.encode(), uuid.uuid4().hex.encode())
            await refusal(scope, receive, send_with_id)
            return
        state = scope.setdefault("state", {})
        state.update(request_id=request_id, request_id_given=bool(given))
        await self.app(scope, receive, send_with_id)
