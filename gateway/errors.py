"""Every failure the gateway answers, in vLLM's error shape and with the right status.

`GatewayError` is the one error type: raised anywhere (a bad body, a refused request, a router
status), it becomes vLLM's `ErrorResponse`, `{"error": {message, type, param, code}}`: `type`
is the name vLLM gives that error (`BadRequestError`, `NotFoundError`, ... or the status
phrase, `vllm_type`), `code` the HTTP status as an integer; a 401 is vLLM's bare
`{"error": "Unauthorized"}`. So a client written against vLLM reads ours unchanged.

The router's gRPC statuses map onto HTTP here (`error_from_rpc`: INVALID_ARGUMENT 400,
RESOURCE_EXHAUSTED 429 + Retry-After, UNAVAILABLE 503 + Retry-After, ...). The router names a
field by its router.proto path (`sampling.structured_output.regex`); the answer names it as
the request body did (`structured_outputs.regex`, `guided_regex`, `response_format.json_schema`:
`ROUTER_FIELDS`, `body_field`). Pydantic's validation errors are a 400 naming the field as
`param`. An exception nothing expected is a JSON 500 that keeps the client's keep-alive
connection (`UnexpectedErrorMiddleware`).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field, replace
from http import HTTPStatus
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


# -- vLLM's error shape ----------------------------------------------------------------------------
# vLLM (vllm/entrypoints/serve/exception_handling/) names its own errors by class
# (`create_error_response`: BadRequestError 400, NotFoundError 404, UnprocessableEntityError 422,
# InternalServerError 500, NotImplementedError 501); everything else carries the status phrase:
# framework errors (unknown route, wrong method: `http_exception_handler`), a body pydantic
# refused ("Bad Request": `validation_exception_handler`) and refusals with an explicit status
# (`GracefulHTTPError`, e.g. "Service Unavailable").
VLLM_ERROR_CLASSES: dict[int, str] = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
}

UNAUTHORIZED_BODY: dict[str, Any] = {"error": "Unauthorized"}
"""vLLM's 401 body, verbatim (vllm/entrypoints/serve/middleware/authenticate.py)."""


def status_phrase(status: int) -> str:
    """The status's reason phrase, as vLLM writes it for a framework error (`HTTPStatus`)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # e.g. 499, ours for a client that left (never actually sent)
        return "Error"


def vllm_type(status: int) -> str:
    """The `type` vLLM answers a status with when its own code refuses the request."""
    return VLLM_ERROR_CLASSES.get(status) or status_phrase(status)


@dataclass
class GatewayError(Exception):
    """An error to answer in vLLM's shape: `{"error": {message, type, param, code}}`.

    `type` defaults to vLLM's name for `status`; `param` names the field as the request body
    does. `code` is our reason (e.g. "invalid_api_key"), for logs and callers only: on the wire
    `code` is the HTTP status, as vLLM sends it. `router_message` keeps a router refusal's
    words, so that the answer can name the field as this request wrote it (`in_body_terms`).
    """

    status: int
    message: str
    type: str = ""
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    router_message: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.type:
            self.type = vllm_type(self.status)

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict[str, Any]:
        if self.status == HTTPStatus.UNAUTHORIZED:
            return dict(UNAUTHORIZED_BODY)
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


class ErrorBody(BaseModel):
    """The shape `GatewayError.body()` answers with (vLLM's `ErrorInfo`; documentation)."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody


def error_response(error: GatewayError) -> JSONResponse:
    headers = dict(error.headers)
    if error.status == HTTPStatus.UNAUTHORIZED:
        # vLLM's body says only "Unauthorized"; the header says how to authenticate (RFC 9110).
        headers.setdefault("WWW-Authenticate", "Bearer")
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def internal_error(exc: Exception) -> GatewayError:
    return GatewayError(500, f"internal error: {type(exc).__name__}: {exc}")


def generation_failed(message: str) -> GatewayError:
    """A sequence the engines ended with FINISH_REASON_ERROR (vLLM: a 500 GenerationError)."""
    return GatewayError(500, f"generation failed: {message}")


def invalid_body(message: str, param: str | None = None) -> GatewayError:
    """A body that is not a valid request (unreadable, or fields pydantic refused): vLLM refuses
    it in its request validation, a 400 typed "Bad Request"."""
    return GatewayError(400, message, type=status_phrase(400), param=param)


# -- router fields, named as the request body names them -------------------------------------------
ROUTER_FIELDS: dict[str, str] = {
    # router.proto path (less its `sampling.` or `chat.` message) → the body's field, where the
    # two differ. Every other field has the body's name; structured outputs depend on the body
    # (`_structured_output_field`), and so do `prompt`, `max_tokens` and `logprobs` (`body_field`).
    "prompt.token_ids": "prompt",
    "token_ids": "prompt",
    "tools_json": "tools",
    "request_id": "X-Request-Id",
}
_ROUTER_MESSAGES = ("sampling.", "chat.")  # GenerateRequest's sub-messages, not body objects

# vLLM's `structured_outputs` keys and the `guided_*` suffixes, by router.proto's kind.
_STRUCTURED_KEYS = {"json_schema": "json"}
_FIELD_AT_START = re.compile(r"[a-z_][\w.]*(?:\[\d+\][\w.]*)*")  # messages[1].role


def _structured_output_field(kind: str, body: BaseModel | None) -> str:
    """The body field that set the structured output of `kind` ("" when the router names none)."""
    key = _STRUCTURED_KEYS.get(kind, kind)
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format.type != "text":
        return "response_format.json_schema" if kind == "json_schema" else "response_format"
    if getattr(body, f"guided_{key}", None) is not None:
        return f"guided_{key}"
    if getattr(body, "structured_outputs", None) is None and getattr(body, "tools", None):
        return "tools"  # tool calling's own constraint (a tool's parameters schema)
    return f"structured_outputs.{key}" if key else "structured_outputs"


def body_field(path: str, body: BaseModel | None = None) -> str:
    """The request-body name of the field the router calls `path` (`sampling.top_p` → `top_p`);
    `body`, when known, picks among the names a request may have used."""
    name = _unprefixed(path)
    if name == "structured_output" or name.startswith("structured_output."):
        return _structured_output_field(name.partition(".")[2], body)
    name = ROUTER_FIELDS.get(name, name)
    if body is None:
        return name
    if name == "prompt":
        if "tokens" in type(body).model_fields:
            return "tokens"  # /detokenize
        if getattr(body, "messages", None) is not None:
            return "messages"  # a chat, or /tokenize of one
    if name == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    if name == "logprobs" and isinstance(getattr(body, "logprobs", None), bool):
        return "top_logprobs"  # chat's count of alternatives
    return name


def _unprefixed(path: str) -> str:
    """`path` without the router.proto message it sits in (`sampling.top_p` → `top_p`)."""
    for prefix in _ROUTER_MESSAGES:
        if path.startswith(prefix):
            return path[len(prefix):]
    return path


def _starts_with_name(text: str, name: str) -> bool:
    """`text` begins with the whole field name `name` ("top_p must ...", not "top_pk")."""
    if not name or not text.startswith(name):
        return False
    rest = text[len(name):]
    return not rest or not (rest[0].isalnum() or rest[0] in "_.")


def _router_field(message: str) -> str | None:
    """The field a router INVALID_ARGUMENT names: it words them `<path>: <why>`, or begins the
    why with the path itself (`stream_interval must be ...`)."""
    match = _FIELD_AT_START.match(message)
    if match is None:
        return None
    path, rest = match.group(), message[match.end():]
    if rest.startswith(": ") or (("." in path or "_" in path) and rest[:1] in ("", " ", "[")):
        return path
    return None


def invalid_argument(message: str, body: BaseModel | None = None) -> GatewayError:
    """The router's INVALID_ARGUMENT as a 400 naming the field as `body` wrote it, without the
    router's path: "sampling.top_p: top_p must be in (0, 1]" → "top_p must be in (0, 1]"."""
    path = _router_field(message)
    if path is None:
        return GatewayError(400, message, router_message=message)
    name = body_field(path, body)
    rest = message[len(path):]
    if rest.startswith(": "):
        why = rest[2:]
        bare = _unprefixed(path)
        # The engine's words name the field again, by its own name: say it once, the body's way.
        text = name + why[len(bare):] if _starts_with_name(why, bare) else f"{name}: {why}"
    else:
        text = name + rest
    return GatewayError(400, text, param=name, router_message=message)


def in_body_terms(error: GatewayError, body: BaseModel | None) -> GatewayError:
    """`error` naming its field as this request's body did (a router refusal; others as is)."""
    if error.router_message is None or body is None:
        return error
    named = invalid_argument(error.router_message, body)
    return replace(error, message=named.message, param=named.param)


_BODY_STATE = "parsed_body"


def remember_body(request: Request, body: BaseModel) -> None:
    """Keep the request's parsed body, for the error handler to name fields as it does."""
    setattr(request.state, _BODY_STATE, body)


def remembered_body(request: Request) -> BaseModel | None:
    body = getattr(request.state, _BODY_STATE, None)
    return body if isinstance(body, BaseModel) else None


# -- router statuses -------------------------------------------------------------------------------
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
    """Map the router's status taxonomy (router.proto) onto HTTP statuses, typed as vLLM types
    them (a status vLLM has no error class for: its phrase, as vLLM's GracefulHTTPError)."""
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return invalid_argument(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return GatewayError(404, details, param="model", code="model_not_found")
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return GatewayError(409, details, code="request_id_in_use")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return GatewayError(429, details, code="rate_limit_exceeded",
                            headers={"Retry-After": str(_retry_after_s(error))})
    if code == grpc.StatusCode.UNAVAILABLE:  # no instance could take it (or no router): retry
        return GatewayError(503, details or "no backend available", code="no_backend",
                            headers={"Retry-After": str(_retry_after_s(error))})
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayError(504, details or "deadline exceeded", code="timeout")
    return GatewayError(500, f"{code.name}: {details}")


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
    """A 400 naming the first problem's field (and how many more there are), typed as vLLM's
    request validation types it ("Bad Request")."""
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    param = validation_param(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid request"))
    if first.get("type") == "value_error" and "error" in first.get("ctx", {}):
        message = str(first["ctx"]["error"])  # our validators' words, without "Value error, "
    if first.get("type") == "missing" and param is None:
        message = "the body is empty; expected a JSON object"  # the whole body is missing
    elif param and not _starts_with_name(message, param):
        message = f"{param}: {message}"  # "messages: Field required"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return invalid_body(message, param)


# -- the app's handlers ----------------------------------------------------------------------------
def install_error_handlers(app: FastAPI) -> None:
    """Answer our errors, validation errors and Starlette's own (404, 405) in vLLM's shape."""

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return error_response(in_body_terms(exc, remembered_body(request)))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # vLLM's http_exception_handler: the status phrase as the type ("Not Found").
        return error_response(GatewayError(exc.status_code, str(exc.detail),
                                           type=status_phrase(exc.status_code),
                                           headers=dict(exc.headers or {})))

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
