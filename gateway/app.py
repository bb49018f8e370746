"""The OpenAI-compatible HTTP routes (FastAPI), translated to router gRPC calls.

One HTTP generation request becomes one router `Generate` call per prompt (completions accept
several prompts; choice index = prompt index × n + sequence index, as OpenAI numbers them).
Errors raised before any output answer with the mapped HTTP status (router_client.py); a
streaming response only starts once every call produced its first message, so a refusal is
still a proper status and not a broken stream. Every call is cancelled when the HTTP client
goes away (`DisconnectWatch`), which makes the router abort the request everywhere.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdmesh import __version__
from pdmesh.gateway.body import (
    LARGE_BODY_BYTES,
    BodyTooLarge,
    ClientGone,
    MemoryReleaser,
    read_body,
    replay,
)
from pdmesh.gateway.config import GatewayConfig
from pdmesh.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from pdmesh.gateway.openai_format import (
    SequenceState,
    chat_choice,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    echo_logprobs,
    finish_reason,
    stop_reason,
    tool_finish_reason,
)
from pdmesh.gateway.router_client import GatewayError, GenerateCall, RouterClient
from pdmesh.gateway.schemas import (
    ChatChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    validation_param,
)
from pdmesh.gateway.tool_parsers import StreamEvents
from pdmesh.gateway.tools import OutputStream, ToolPlan, plan_tools
from pdmesh.tracing import extract_headers, get_tracer, inject_metadata
from pdmesh.v1 import common_pb2, router_pb2

logger = logging.getLogger(__name__)

T = TypeVar("T")
Kind = Literal["completion", "chat"]
CLIENT_CLOSED = 499  # nginx's convention; only ever seen in logs and metrics
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
              "/tokenize", "/detokenize", "/version")
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_BYTES = 128  # the router's limit (router/server.py)


def error_response(error: GatewayError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


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


@dataclass
class Generation:
    """One HTTP generation request in flight: its router calls and what it has produced."""

    kind: Kind
    id: str
    created: int
    model: str
    n: int
    want_logprobs: bool
    include_usage: bool
    calls: list[GenerateCall]
    # Completions `echo`: each prompt's text, put before its choices' output; with logprobs,
    # each prompt's first token (the one the prompt logprobs do not cover).
    echo: list[str] | None = None
    echo_first_tokens: list[str] | None = None
    # Chat tool calling: how to read the output (None: plain content).
    tools: ToolPlan | None = None
    # stream_options.continuous_usage_stats: usage in every chunk; the prompts' token count is
    # known up front (a Tokenize call), the completion tokens as they stream.
    continuous_usage: bool = False
    prompt_tokens: int = 0
    streamed_tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    ok: bool = False  # answered in full, without error
    usage: UsageInfo = field(default_factory=UsageInfo)
    span: Span | None = None  # the trace's root span on this hop

    def close(self) -> None:
        for call in self.calls:
            call.close()

    def saw_delta(self, delta: common_pb2.SequenceDelta) -> None:
        if self.first_token_at is None and (delta.token_ids or delta.text):
            self.first_token_at = time.monotonic()


_END = object()


class OpenAIServing:
    """Route handlers sharing one router client and one metrics registry."""

    def __init__(self, config: GatewayConfig, client: RouterClient, metrics: GatewayMetrics):
        self.config = config
        self.client = client
        self.metrics = metrics
        self.started = int(time.time())
        self._default_model: str | None = None

    # -- small endpoints ---------------------------------------------------------------------
    async def models(self) -> ModelList:
        models = await self.client.list_models()
        return ModelList(
            data=[ModelCard(id=m.id, created=self.started, max_model_len=m.max_model_len)
                  for m in models]
        )

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: the router tokenizes exactly as Generate would."""
        out = await self.client.tokenize(body.to_proto())
        tokens = list(out.token_ids)
        strs = None
        if body.return_token_strs:
            strs = list((await self.client.detokenize(router_pb2.DetokenizeRequest(
                model=body.model, token_ids=tokens))).token_strs)
        return TokenizeResponse(count=len(tokens), max_model_len=out.max_model_len,
                                tokens=tokens, token_strs=strs)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        out = await self.client.detokenize(router_pb2.DetokenizeRequest(
            model=body.model, token_ids=body.tokens))
        return DetokenizeResponse(prompt=out.text)

    async def _echo_texts(self, body: CompletionRequest) -> list[str]:
        """Each prompt's text for `echo` (token-id prompts decoded by the router)."""
        texts = []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                texts.append(prompt)
            else:
                texts.append((await self.client.detokenize(router_pb2.DetokenizeRequest(
                    model=body.model, token_ids=prompt))).text)
        return texts

    async def _first_tokens(self, body: CompletionRequest) -> list[str]:
        """Each prompt's first token's text, for `echo` with logprobs."""
        firsts = []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                prompt = list((await self.client.tokenize(router_pb2.TokenizeRequest(
                    model=body.model, text=prompt))).token_ids)
            out = await self.client.detokenize(router_pb2.DetokenizeRequest(
                model=body.model, token_ids=prompt[:1]))
            firsts.append(out.text)
        return firsts

    async def _count_prompt_tokens(self, requests: list[router_pb2.GenerateRequest]) -> int:
        total = 0
        for r in requests:
            kind = r.WhichOneof("prompt")
            if kind == "token_ids":
                total += len(r.token_ids.ids)
                continue
            tokenize = router_pb2.TokenizeRequest(model=r.model)
            if kind == "text":
                tokenize.text = r.text
            else:
                tokenize.chat.CopyFrom(r.chat)
            total += len((await self.client.tokenize(tokenize)).token_ids)
        return total

    async def health(self) -> JSONResponse:
        """Readiness: 200 while the router can serve a request now, else 503 and why."""
        health = await self.client.healthy()
        if health.serving:
            return JSONResponse({"status": "ok", "router": health.status})
        body = {"status": "unavailable", "router": health.status, "reason": health.reason}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    async def model_name(self, requested: str) -> str:
        """The name echoed in responses: the request's, or the served model's."""
        if requested:
            return requested
        if self._default_model is None:
            models = await self.client.list_models()
            if len(models) != 1:
                return ""
            self._default_model = models[0].id
        return self._default_model

    # -- generation --------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        base = request_id_of(request)
        prompts = body.prompts()
        # The client's X-Request-Id is the router's request id (logs, traces, cancellation).
        grpc_requests = [body.to_generate(p, base if len(prompts) == 1 else f"{base}-{i}")
                         for i, p in enumerate(prompts)]
        return await self._generate(
            "completion", f"cmpl-{base}", body.model, body.n, body.logprobs is not None,
            body.include_usage_in_stream, body.stream, grpc_requests, request,
            echo=await self._echo_texts(body) if body.echo else None,
            echo_first_tokens=await self._first_tokens(body) if body.echo_logprobs else None,
            continuous_usage=body.continuous_usage,
        )

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        base = request_id_of(request)
        tools = plan_tools(body, self.config.tool_settings)
        generate = (body.to_generate(base) if tools is None else
                    body.to_generate(base, tools.tools_json, tools.structured_output))
        return await self._generate(
            "chat", f"chatcmpl-{base}", body.model, body.n, body.logprobs,
            body.include_usage_in_stream, body.stream, [generate], request,
            continuous_usage=body.continuous_usage, tools=tools,
        )

    async def _generate(
        self, kind: Kind, rid: str, model: str, n: int, want_logprobs: bool,
        include_usage: bool, stream: bool, grpc_requests: list[router_pb2.GenerateRequest],
        request: Request, *, echo: list[str] | None = None,
        echo_first_tokens: list[str] | None = None, continuous_usage: bool = False,
        tools: ToolPlan | None = None,
    ) -> Response:
        endpoint = request.url.path
        served_model = await self.model_name(model)
        prompt_tokens = (await self._count_prompt_tokens(grpc_requests)
                         if continuous_usage else 0)
        # The HTTP caller's traceparent (if any) parents this hop; the router calls carry ours.
        span = get_tracer().start_span(
            "pdmesh.gateway.request", context=extract_headers(request.headers),
            kind=SpanKind.SERVER,
            attributes={"http.route": endpoint, "gen_ai.request.model": served_model,
                        "gen_ai.operation.name": kind,
                        "pdmesh.request_id": request_id_of(request)},
        )
        metadata = inject_metadata(ctx=trace.set_span_in_context(span))
        gen = Generation(
            kind=kind, id=rid, created=int(time.time()), model=served_model,
            n=n, want_logprobs=want_logprobs, include_usage=include_usage,
            calls=[self.client.generate(r, metadata=metadata) for r in grpc_requests],
            span=span, echo=echo, echo_first_tokens=echo_first_tokens,
            continuous_usage=continuous_usage, prompt_tokens=prompt_tokens, tools=tools,
        )
        watch = DisconnectWatch(request, gen.close)
        self.metrics.in_flight.labels(endpoint).inc()
        handed_over = False
        try:
            if not stream:
                result = await self._until_disconnect(watch, self._collect(gen))
                return result if result is not None else Response(status_code=CLIENT_CLOSED)
            iterators = [call.__aiter__() for call in gen.calls]
            firsts = await self._until_disconnect(
                watch, asyncio.gather(*(anext(it, _END) for it in iterators))
            )
            if firsts is None:
                return Response(status_code=CLIENT_CLOSED)
            handed_over = True
            return StreamingResponse(
                self._sse(gen, watch, iterators, list(firsts), endpoint),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        finally:
            if not handed_over:
                self._finished(gen, watch, endpoint)

    async def _until_disconnect(self, watch: DisconnectWatch, work: Awaitable[T]) -> T | None:
        """`work`'s result, or None when the client left first (the calls are cancelled)."""
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

    def _finished(self, gen: Generation, watch: DisconnectWatch, endpoint: str) -> None:
        watch.stop()
        gen.close()
        self.metrics.in_flight.labels(endpoint).dec()
        if watch.fired:
            self.metrics.disconnects.labels(endpoint).inc()
        logger.info("request_id=%s endpoint=%s ok=%s disconnected=%s", gen.id, endpoint,
                    gen.ok, watch.fired)
        if gen.span is not None:
            gen.span.set_attributes({
                "gen_ai.usage.input_tokens": gen.usage.prompt_tokens,
                "gen_ai.usage.output_tokens": gen.usage.completion_tokens,
                "pdmesh.client_disconnected": watch.fired,
            })
            if not gen.ok and not watch.fired:
                gen.span.set_status(trace.StatusCode.ERROR)
            gen.span.end()
        if not gen.ok:
            return
        now = time.monotonic()
        if gen.first_token_at is not None:
            self.metrics.ttft.labels(endpoint).observe(gen.first_token_at - gen.started)
        self.metrics.e2e.labels(endpoint).observe(now - gen.started)
        self.metrics.prompt_tokens.inc(gen.usage.prompt_tokens)
        self.metrics.cached_prompt_tokens.inc(gen.usage.prompt_tokens_details.cached_tokens)
        self.metrics.generation_tokens.inc(gen.usage.completion_tokens)

    async def _collect(self, gen: Generation) -> JSONResponse:
        states: dict[int, SequenceState] = {}
        prompt_logprobs: dict[int, list[common_pb2.TokenLogprob]] = {}

        async def one(p: int, call: GenerateCall) -> None:
            async for resp in call:
                if resp.HasField("delta"):
                    gen.saw_delta(resp.delta)
                    states.setdefault(p * gen.n + resp.delta.index, SequenceState()).add(
                        resp.delta
                    )
                elif resp.HasField("result"):
                    gen.usage.add(resp.result.usage)
                    prompt_logprobs[p] = list(resp.result.prompt_logprobs)

        await asyncio.gather(*(one(p, call) for p, call in enumerate(gen.calls)))
        failed = [s.finish for s in states.values()
                  if s.finish is not None and s.finish.reason == common_pb2.FINISH_REASON_ERROR]
        if failed:
            raise GatewayError(500, f"generation failed: {failed[0].message}",
                               type="internal_error")
        indices = sorted(states)
        body: CompletionResponse | ChatCompletionResponse
        if gen.kind == "completion":
            choices = [completion_choice(i, states[i], gen.want_logprobs) for i in indices]
            if gen.echo is not None:
                for choice in choices:
                    p = choice.index // gen.n
                    if gen.echo_first_tokens is not None:
                        choice.logprobs = echo_logprobs(
                            gen.echo_first_tokens[p], prompt_logprobs.get(p, []),
                            states[choice.index].logprobs, len(gen.echo[p]))
                    choice.text = gen.echo[p] + choice.text
            body = CompletionResponse(
                id=gen.id, created=gen.created, model=gen.model, usage=gen.usage,
                choices=choices,
            )
        else:
            body = ChatCompletionResponse(
                id=gen.id, created=gen.created, model=gen.model, usage=gen.usage,
                choices=[chat_choice(i, states[i], gen.want_logprobs, gen.tools)
                         for i in indices],
            )
        gen.ok = True
        return JSONResponse(body.model_dump(mode="json"))

    async def _sse(
        self, gen: Generation, watch: DisconnectWatch, iterators: list[Any],
        firsts: list[Any], endpoint: str,
    ) -> AsyncIterator[str]:
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(p: int) -> None:
            try:
                if firsts[p] is not _END:
                    await queue.put((p, firsts[p]))
                    async for resp in iterators[p]:
                        await queue.put((p, resp))
                await queue.put((p, _END))
            except GatewayError as exc:
                await queue.put((p, exc))
            except asyncio.CancelledError:
                # The call was cancelled (client gone, or cleanup): nothing left to read.
                await queue.put((p, GatewayError(CLIENT_CLOSED, "cancelled")))

        pumps = [asyncio.create_task(pump(p)) for p in range(len(gen.calls))]
        offsets: dict[int, int] = {}
        readers: dict[int, OutputStream | None] = {}  # per choice, with tool calling
        error: GatewayError | None = None
        try:
            if gen.kind == "chat":
                for i in range(len(gen.calls) * gen.n):
                    yield _sse_chunk(gen, i, text=None, role=True)
            elif gen.echo is not None and gen.echo_first_tokens is None:
                for i in range(len(gen.calls) * gen.n):
                    yield _sse_chunk(gen, i, text=gen.echo[i // gen.n])
            echoed: set[int] = set()  # echo with logprobs: prompts whose echo went out
            ended = 0
            while ended < len(pumps):
                p, item = await queue.get()
                if item is _END:
                    ended += 1
                    continue
                if isinstance(item, GatewayError):
                    error = item
                    break
                if item.HasField("result"):
                    gen.usage.add(item.result.usage)
                    continue
                if gen.echo_first_tokens is not None and p not in echoed:
                    # The prompt's logprobs come before its first delta; without them (an
                    # instance that does not send them) the echo goes out without logprobs.
                    echoed.add(p)
                    entries = list(item.prompt_logprobs.entries) \
                        if item.HasField("prompt_logprobs") else None
                    for chunk, index, offset in _echo_chunks(gen, p, entries):
                        offsets[index] = offset
                        yield chunk
                if item.HasField("prompt_logprobs"):
                    continue
                delta = item.delta
                gen.saw_delta(delta)
                gen.streamed_tokens += len(delta.token_ids)
                if not (delta.text or delta.logprobs or delta.HasField("finish")):
                    continue
                index = p * gen.n + delta.index
                offset = offsets.get(index, 0)
                offsets[index] = offset + sum(len(lp.text) for lp in delta.logprobs)
                if gen.tools is not None:
                    if index not in readers:
                        readers[index] = gen.tools.stream()
                    reader = readers[index]
                    if reader is not None:
                        events = _read_tools(reader, delta)
                        if events.content or events.tool_calls or delta.logprobs or \
                                delta.HasField("finish"):
                            yield _sse_chunk(gen, index, text=events.content, delta=delta,
                                             tool_calls=events, called=reader.num_calls > 0)
                        continue
                yield _sse_chunk(gen, index, text=delta.text, delta=delta, offset=offset)
                if delta.finish.reason == common_pb2.FINISH_REASON_ERROR and error is None:
                    error = GatewayError(500, f"generation failed: {delta.finish.message}",
                                         type="internal_error")
            if error is not None:
                yield f"data: {_json(error.body())}\n\n"
            elif gen.include_usage:
                chunk = _chunk_envelope(gen, [])
                chunk["usage"] = gen.usage.model_dump(mode="json")
                yield f"data: {_json(chunk)}\n\n"
            yield "data: [DONE]\n\n"
            gen.ok = error is None
        finally:
            for task in pumps:
                task.cancel()
            self._finished(gen, watch, endpoint)


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _chunk_envelope(gen: Generation, choices: list[dict[str, Any]]) -> dict[str, Any]:
    obj = "text_completion" if gen.kind == "completion" else "chat.completion.chunk"
    usage = None
    if gen.continuous_usage:
        usage = {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.streamed_tokens,
                 "total_tokens": gen.prompt_tokens + gen.streamed_tokens}
    return {"id": gen.id, "object": obj, "created": gen.created, "model": gen.model,
            "choices": choices, "usage": usage}


def _read_tools(reader: OutputStream, delta: common_pb2.SequenceDelta) -> StreamEvents:
    """A delta's text read for tool calls; the sequence's last delta also ends the reading."""
    events = reader.feed(delta.text)
    if delta.HasField("finish"):
        rest = reader.finish()
        events.content += rest.content
        events.tool_calls += rest.tool_calls
    return events


def _echo_chunks(
    gen: Generation, p: int, prompt_logprobs: list[common_pb2.TokenLogprob] | None,
) -> list[tuple[str, int, int]]:
    """Completions `echo` with logprobs, streamed: prompt `p`'s text as the first chunk of
    each of its choices, with the prompt tokens' logprobs (as vLLM streams them), and where
    each choice's output text starts (its logprobs' text_offset)."""
    assert gen.echo is not None and gen.echo_first_tokens is not None
    text = gen.echo[p]
    out = []
    for index in range(p * gen.n, (p + 1) * gen.n):
        logprobs = None
        if prompt_logprobs is not None:
            logprobs = echo_logprobs(gen.echo_first_tokens[p], prompt_logprobs, [], len(text))
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                  finish_reason=None).model_dump(mode="json")
        out.append((f"data: {_json(_chunk_envelope(gen, [choice]))}\n\n", index, len(text)))
    return out


def _sse_chunk(
    gen: Generation, index: int, *, text: str | None, role: bool = False,
    delta: common_pb2.SequenceDelta | None = None, offset: int = 0,
    tool_calls: StreamEvents | None = None, called: bool = False,
) -> str:
    finish = delta.finish if delta is not None and delta.HasField("finish") else None
    logprobs = list(delta.logprobs) if delta is not None and gen.want_logprobs else None
    choice: dict[str, Any]
    if gen.kind == "completion":
        choice = CompletionChoice(
            index=index, text=text or "",
            logprobs=completion_logprobs(logprobs, offset) if logprobs is not None else None,
            finish_reason=finish_reason(finish), stop_reason=stop_reason(finish),
        ).model_dump(mode="json")
    else:
        message = DeltaMessage(role="assistant", content="") if role else DeltaMessage(
            content=text or None,
            tool_calls=[d.to_openai() for d in tool_calls.tool_calls] if tool_calls and
            tool_calls.tool_calls else None,
        )
        choice = ChatChunkChoice(
            index=index, delta=message,
            logprobs=chat_logprobs(logprobs) if logprobs is not None else None,
            finish_reason=tool_finish_reason(finish_reason(finish), called),
            stop_reason=stop_reason(finish),
        ).model_dump(mode="json")
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return f"data: {_json(_chunk_envelope(gen, [choice]))}\n\n"


# -- the app ---------------------------------------------------------------------------------------
def _validation_error(exc: RequestValidationError) -> GatewayError:
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return GatewayError(400, f"the body is not valid JSON: {first.get('msg')}")
    param = validation_param(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid request"))
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return GatewayError(400, message, param=param)


def create_app(config: GatewayConfig, client: RouterClient | None = None) -> FastAPI:
    """The gateway app. Without `client`, one to `config.router_address` is opened at start-up
    and closed at shutdown (closing it cancels every call still running)."""
    metrics = GatewayMetrics()
    holder: dict[str, OpenAIServing] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router = client or RouterClient(
            config.router_address, tls=config.tls, max_message_bytes=config.max_message_bytes,
            request_timeout_s=config.request_timeout_s,
            control_timeout_s=config.control_timeout_s,
        )
        holder["serving"] = OpenAIServing(config, router, metrics)
        try:
            yield
        finally:
            if client is None:
                await router.close()

    app = FastAPI(title="pdmesh OpenAI-compatible gateway", lifespan=lifespan)
    app.state.metrics = metrics
    # The last added runs first: CORS answers preflights before the API key is asked for, and
    # every answer, refusals included, carries its X-Request-Id.
    app.add_middleware(GuardMiddleware, config=config, metrics=metrics)
    app.add_middleware(RequestIdMiddleware)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            allow_credentials=config.allow_credentials,
            expose_headers=[REQUEST_ID_HEADER],
        )

    def serving() -> OpenAIServing:
        return holder["serving"]

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return error_response(GatewayError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(GatewayError(500, f"internal error: {exc}", type="internal_error"))

    @app.get("/health")
    async def health() -> Response:
        return await serving().health()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return await serving().models()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await serving().tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await serving().detokenize(body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving().completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving().chat(body, request)

    return app


def request_id_of(request: Request) -> str:
    """The request's id: the client's X-Request-Id, or one made up (`RequestIdMiddleware`)."""
    return str(request.scope.get("state", {}).get("request_id") or uuid.uuid4().hex)


class RequestIdMiddleware:
    """X-Request-Id in and out, as vLLM does: the client's id (or a new one) becomes the
    router's request id, so it names the request in every service's logs and traces, and is
    sent back on the response. An id the router would refuse (too long, not printable) is a
    400 here, naming the header."""

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

        if (not request_id or not request_id.isprintable()
                or len(request_id.encode()) > MAX_REQUEST_ID_BYTES):
            refusal = error_response(GatewayError(
                400, f"X-Request-Id must be printable and at most {MAX_REQUEST_ID_BYTES} bytes",
                param="X-Request-Id"))
            header = (REQUEST_ID_HEADER.encode(), uuid.uuid4().hex.encode())
            await refusal(scope, receive, send_with_id)
            return
        scope.setdefault("state", {})["request_id"] = request_id
        await self.app(scope, receive, send_with_id)


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
        endpoint = path if path in _ENDPOINTS else "other"

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
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), config.api_key.encode()
        ):
            return error_response(GatewayError(
                401, "invalid or missing API key (Authorization: Bearer <key>)",
                code="invalid_api_key",
            ))
    length = headers.get("content-length", "")
    if length.isdigit() and int(length) > config.max_request_bytes:
        return _too_large(config)
    return None


def _too_large(config: GatewayConfig) -> JSONResponse:
    """413; the connection is closed after it, so the rest of the body is never read."""
    return error_response(GatewayError(
        413, f"request body over {config.max_request_bytes} bytes", code="body_too_large",
        headers={"connection": "close"},
    ))
