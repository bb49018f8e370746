"""The gate every HTTP request passes first: the API key on /v1/*, the body cap, and the count
of every answer by endpoint and status."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdmesh.gateway.body import (
    LARGE_BODY_BYTES,
    BodyTooLarge,
    ClientGone,
    MemoryReleaser,
    read_body,
    replay,
)
from pdmesh.gateway.config import GatewayConfig
from pdmesh.gateway.errors import GatewayError, error_response
from pdmesh.gateway.metrics import GatewayMetrics

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ping",
             "/metrics", "/tokenize", "/detokenize", "/version")
"""The paths counted under their own name; any other is counted as "other" (a bounded label
set, whatever paths clients try)."""


class GuardMiddleware:
    """Pure ASGI (so disconnects and streaming pass through untouched): refuses a bad API key
    on /v1/* and an oversized body, and counts every answer.

    The body cap holds while the body streams in, whatever its framing: a `Content-Length`
    over the cap is refused before anything is read, and any body (chunked ones too) is read
    here, into at most `max_request_bytes`, and refused with 413 as soon as more arrives,
    without reading the rest (see gateway/body.py). The app then reads the buffered body.
    Shortly after a large body, the memory it used is handed back to the OS (`MemoryReleaser`).
    """

    def __init__(self, app: ASGIApp, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.app = app
        self.config = config
        self.metrics = metrics
        self.releaser = MemoryReleaser()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = str(message["status"])
                self.metrics.requests.labels(endpoint, status).inc()
                if message["status"] >= 400:
                    self.metrics.errors.labels(endpoint, status).inc()
            await send(message)

        refusal = _refuse(self.config, path, Headers(scope=scope))
        if refusal is not None:
            await refusal(scope, receive, counting_send)
            return
        try:
            body = await read_body(receive, self.config.max_request_bytes)
        except ClientGone:
            return  # nobody to answer
        except BodyTooLarge:
            self.releaser.soon()  # what was buffered up to the cap
            await _too_large(self.config)(scope, receive, counting_send)
            return
        large = len(body) >= LARGE_BODY_BYTES
        replayed = replay(body, receive)
        del body  # only `replayed` holds it, until the app has read it
        try:
            await self.app(scope, replayed, counting_send)
        finally:
            if large:
                self.releaser.soon()


def _refuse(config: GatewayConfig, path: str, headers: Headers) -> JSONResponse | None:
    if config.api_key and path.startswith("/v1/"):
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not _known_key(token.strip(), config.api_keys):
            return error_response(GatewayError(
                401, "invalid or missing API key (Authorization: Bearer <key>)",
                code="invalid_api_key",
            ))
    length = headers.get("content-length", "")
    if length.isdigit() and int(length) > config.max_request_bytes:
        return _too_large(config)
    return None


def _known_key(token: str, keys: tuple[str, ...]) -> bool:
    """Whether `token` is one of `keys`, compared with every key in constant time (which key
    matched, or how far, does not show in the time taken)."""
    presented = token.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(presented, key.encode())
    return found


def _too_large(config: GatewayConfig) -> JSONResponse:
    """413; the connection is closed after it, so the rest of the body is never read."""
    return error_response(GatewayError(
        413, f"request body over {config.max_request_bytes} bytes", code="body_too_large",
        headers={"connection": "close"},
    ))
