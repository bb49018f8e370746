"""Every failure the gateway answers, in OpenAI's error shape and with the right status.

`GatewayError` is the one error type: raised anywhere (a bad body, a refused request, a router
status), it becomes `{"error": {message, type, param, code}}` with its HTTP status and headers.
The router's gRPC statuses map onto HTTP here (`error_from_rpc`: INVALID_ARGUMENT 400,
RESOURCE_EXHAUSTED 429 + Retry-After, UNAVAILABLE 503 + Retry-After, ...), and so do pydantic's
validation errors (a 400 naming the field as OpenAI's `param`). An exception nothing expected
is a JSON 500 that keeps the client's keep-alive connection (`UnexpectedErrorMiddleware`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

RETRY_AFTER_KEY = "retry-after-ms"
"""Trailing metadata the router sets on RESOURCE_EXHAUSTED and UNAVAILABLE (router/admission.py,
router/orchestrator.py)."""


@dataclass
class GatewayError(Exception):
    """An error to answer in OpenAI's shape: `{"error": {message, type, param, code}}`."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class ErrorBody(BaseModel):
    """The shape `GatewayError.body()` answers with (documentation for clients)."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def error_response(error: GatewayError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def internal_error(exc: Exception) -> GatewayError:
    return GatewayError(500, f"internal error: {type(exc).__name__}: {exc}",
                        type="internal_error")


def generation_failed(message: str) -> GatewayError:
    """A sequence the engines ended with FINISH_REASON_ERROR."""
    return GatewayError(500, f"generation failed: {message}", type="internal_error")


# -- router statuses -------------------------------------------------------------------------------
def _param_from_message(message: str) -> str | None:
    """The router words INVALID_ARGUMENT as `<field>: <why>`; the field is OpenAI's `param`."""
    head, sep, _ = message.partition(": ")
    if sep and head and " " not in head:
        return head.removeprefix("sampling.")
    return None


def _retry_after_s(error: grpc.aio.AioRpcError) -> int:
    """Whole seconds for the Retry-After header (rounded up, at least 1)."""
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(1, math.ceil(int(value) / 1000))
            except ValueError:
                break
    return 1


def error_from_rpc(error: grpc.aio.AioRpcError) -> GatewayError:
    """Map the router's status taxonomy (router.proto) onto HTTP statuses."""
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return GatewayError(400, details, param=_param_from_message(details))
    if code == grpc.StatusCode.NOT_FOUND:
        return GatewayError(404, details, param="model", code="model_not_found")
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return GatewayError(409, details, code="request_id_in_use")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry = _retry_after_s(error)
        return GatewayError(429, details, type="rate_limit_error", code="rate_limit_exceeded",
                            headers={"Retry-After": str(retry)})
    if code == grpc.StatusCode.UNAVAILABLE:  # no instance could take it (or no router): retry
        return GatewayError(503, details or "no backend available", type="service_unavailable",
                            code="no_backend",
                            headers={"Retry-After": str(_retry_after_s(error))})
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayError(504, details or "deadline exceeded", type="timeout")
    return GatewayError(500, f"{code.name}: {details}", type="internal_error")


# -- validation errors -----------------------------------------------------------------------------
_UNION_BRANCHES = frozenset({"str", "int", "float", "bool", "dict"})
_UNION_BRANCH_PREFIXES = ("function-", "list[", "dict[", "literal[", "json-or-python[")


def validation_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """The OpenAI `param` for a pydantic error location, e.g. ('body', 'messages', 0) ->
    'messages[0]'."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_BRANCHES or part.startswith(_UNION_BRANCH_PREFIXES):
            continue  # a union branch name, not a field (a field may start with "str")
        else:
            out += f".{part}" if out else part
    return out or None


def validation_error(exc: RequestValidationError) -> GatewayError:
    """A 400 naming the first problem's field (and how many more there are)."""
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    param = validation_param(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid request"))
    if first.get("type") == "value_error" and "error" in first.get("ctx", {}):
        message = str(first["ctx"]["error"])  # our validators' words, without "Value error, "
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return GatewayError(400, message, param=param)


# -- the app's handlers ----------------------------------------------------------------------------
def install_error_handlers(app: FastAPI) -> None:
    """Answer our errors, validation errors and Starlette's own (404, 405) in OpenAI's shape."""

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return error_response(GatewayError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Only for a failure in the outer middlewares; the app's own are answered by
        # UnexpectedErrorMiddleware. Starlette closes the connection after this one.
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(internal_error(exc))


class UnexpectedErrorMiddleware:
    """An exception no handler took, raised before the response started, becomes a JSON 500
    and the connection stays usable.

    Starlette's catch-all (ServerErrorMiddleware, where `exception_handler(Exception)` lives)
    re-raises after answering, so the server closes the connection, and a keep-alive client's
    next request on it fails. Here the exception ends with the answer. One raised after the
    response started (a stream broken midway) is re-raised: that response cannot be completed,
    so the connection must close.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watching_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        except Exception as exc:
            if started:
                raise
            logger.exception("unhandled error on %s", scope.get("path", ""))
            await error_response(internal_error(exc))(scope, receive, send)
