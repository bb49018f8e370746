"""The gateway app (FastAPI): the middleware stack, the error handlers and the route table.

Each route only reads its body and hands it on: the generation routes to their translation
into router calls (gateway/translate.py) and the generation flow (gateway/serving.py), the
others to gateway/info_routes.py. Every malformed request is a 400 naming the field or the
problem, and never costs the client its keep-alive connection: bodies are read by `json_body`
(Content-Type, UTF-8, nesting and surrogates by gateway/body.py's rules; fields and their wire
ranges by the schema modules), and an exception no handler expected is a JSON 500
(gateway/errors.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from pdmesh.gateway import info_routes
from pdmesh.gateway.chat_schemas import ChatCompletionRequest
from pdmesh.gateway.completion_schemas import CompletionRequest
from pdmesh.gateway.config import GatewayConfig
from pdmesh.gateway.context import GatewayContext
from pdmesh.gateway.errors import UnexpectedErrorMiddleware, install_error_handlers
from pdmesh.gateway.guard import GuardMiddleware
from pdmesh.gateway.ignored_fields import IGNORED_FIELDS_HEADER, IgnoredFieldsMiddleware
from pdmesh.gateway.info_schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pdmesh.gateway.json_body import json_body
from pdmesh.gateway.logprobs_limit import check_max_logprobs
from pdmesh.gateway.metrics import GatewayMetrics
from pdmesh.gateway.request_id import REQUEST_ID_HEADER, RequestIdMiddleware, request_id_of
from pdmesh.gateway.responses_formatter import responses_answer
from pdmesh.gateway.responses_schemas import ResponsesRequest
from pdmesh.gateway.router_client import RouterClient
from pdmesh.gateway.serving import serve
from pdmesh.gateway.translate import chat_plan, completion_plan, responses_plan

CompletionBody = Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]
ChatBody = Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))]
TokenizeBody = Annotated[TokenizeRequest, Depends(json_body(TokenizeRequest))]
DetokenizeBody = Annotated[DetokenizeRequest, Depends(json_body(DetokenizeRequest))]
ResponsesBody = Annotated[ResponsesRequest, Depends(json_body(ResponsesRequest))]


def create_app(config: GatewayConfig, client: RouterClient | None = None) -> FastAPI:
    """The gateway app. Without `client`, one to `config.router_address` is opened at start-up
    and closed at shutdown (closing it cancels every call still running)."""
    metrics = GatewayMetrics()
    holder: dict[str, GatewayContext] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router = client or RouterClient(
            config.router_address, tls=config.tls, max_message_bytes=config.max_message_bytes,
            request_timeout_s=config.request_timeout_s,
            control_timeout_s=config.control_timeout_s,
        )
        holder["context"] = GatewayContext(config, router, metrics)
        try:
            yield
        finally:
            if client is None:
                await router.close()

    docs = not config.disable_fastapi_docs
    app = FastAPI(title="pdmesh OpenAI-compatible gateway", lifespan=lifespan,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.metrics = metrics
    # The last added runs first: CORS answers preflights before the API key is asked for, and
    # every answer, refusals included, carries its X-Request-Id (and X-Ignored-Fields after
    # it). Unexpected errors become a JSON 500 innermost, so that it is counted and carries the
    # id too.
    app.add_middleware(UnexpectedErrorMiddleware)
    app.add_middleware(GuardMiddleware, config=config, metrics=metrics)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(IgnoredFieldsMiddleware)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            allow_credentials=config.allow_credentials,
            expose_headers=[REQUEST_ID_HEADER, IGNORED_FIELDS_HEADER],
        )
    install_error_handlers(app)

    def context() -> GatewayContext:
        return holder["context"]

    # Route functions carry no docstrings: FastAPI would publish them in /openapi.json.
    @app.get("/health")
    async def health() -> Response:
        return await info_routes.health(context().client)

    async def ping() -> Response:
        return await info_routes.health(context().client)

    # One route per method: one route for both publishes one operation id twice.
    for method in ("GET", "POST"):
        app.add_api_route("/ping", ping, methods=[method],
                          operation_id=f"ping_{method.lower()}")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return await info_routes.prometheus(context())

    @app.get("/v1/models")
    async def models() -> ModelList:
        return await info_routes.models(context())

    @app.get("/version")
    async def version() -> dict[str, str]:
        return info_routes.version()

    @app.get("/load")
    async def load() -> dict[str, int]:
        return info_routes.load(context())

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> TokenizeResponse:
        return await info_routes.tokenize(context().client, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> DetokenizeResponse:
        return await info_routes.detokenize(context().client, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        check_max_logprobs(body, config.max_logprobs)
        plan = await completion_plan(context().client, body,
                                     request_id_of(request, body.request_id),
                                     config.answer_settings)
        return await serve(context(), plan, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request) -> Response:
        check_max_logprobs(body, config.max_logprobs)
        plan = chat_plan(body, request_id_of(request, body.request_id), config.tool_settings,
                         config.answer_settings, config.reasoning_settings)
        return await serve(context(), plan, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesBody, request: Request) -> Response:
        plan = responses_plan(body, request_id_of(request), config.tool_settings,
                              config.max_logprobs, config.reasoning_settings)
        return await responses_answer(serve(context(), plan, request), plan.formatter)

    return app
