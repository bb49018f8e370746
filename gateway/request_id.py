"""X-Request-Id in and out, as vLLM does: the client's id (or a new one) becomes the router's
request id, so it names the request in every service's logs and traces, and is sent back on
the response."""

from __future__ import annotations

import uuid

from fastapi import Request
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdmesh.gateway.errors import GatewayError, error_response

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_BYTES = 128  # the router's limit (router/server.py)


def request_id_of(request: Request) -> str:
    """The request's id: the client's X-Request-Id, or one made up (`RequestIdMiddleware`)."""
    return str(request.scope.get("state", {}).get("request_id") or uuid.uuid4().hex)


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

        if (not request_id or not request_id.isascii() or not request_id.isprintable()
                or len(request_id) > MAX_REQUEST_ID_BYTES):
            refusal = error_response(GatewayError(
                400, f"X-Request-Id must be printable ASCII and at most {MAX_REQUEST_ID_BYTES} "
                "bytes", param="X-Request-Id"))
            header = (REQUEST_ID_HEADER.encode(), uuid.uuid4().hex.encode())
            await refusal(scope, receive, send_with_id)
            return
        scope.setdefault("state", {})["request_id"] = request_id
        await self.app(scope, receive, send_with_id)
