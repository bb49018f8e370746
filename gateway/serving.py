"""One generation request served: its router calls started under the request's trace span,
answered whole or streamed (gateway/streaming.py) in its API kind's format, cancelled when the
HTTP client goes away, and counted in the metrics when it ends.

Errors raised before any output answer with their HTTP status (gateway/errors.py). Every call
is cancelled when the HTTP client goes away (`DisconnectWatch`), which makes the router abort
the request everywhere; one that left before its answer started is answered (into the void,
so only logs and metrics see it) with 499.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from pdmesh.gateway.context import GatewayContext
from pdmesh.gateway.disconnect import CLIENT_CLOSED, DisconnectWatch, until_disconnect
from pdmesh.gateway.errors import generation_failed
from pdmesh.gateway.formatter import Outputs, ResponseHead
from pdmesh.gateway.generation import Generation
from pdmesh.gateway.metrics import GatewayMetrics
from pdmesh.gateway.openai_format import SequenceState
from pdmesh.gateway.request_id import request_id_of
from pdmesh.gateway.router_client import GenerateCall
from pdmesh.gateway.streaming import first_events, sse_events, sse_response, with_keep_alive
from pdmesh.gateway.translate import GenerationPlan, count_prompt_tokens
from pdmesh.tracing import extract_headers, get_tracer, inject_metadata
from pdmesh.v1 import common_pb2

logger = logging.getLogger(__name__)


async def serve(context: GatewayContext, plan: GenerationPlan, request: Request) -> Response:
    endpoint = request.url.path
    served_model = await context.model_name(plan.model)
    prompt_tokens = (await count_prompt_tokens(context.client, plan.requests)
                     if plan.continuous_usage else 0)
    # The HTTP caller's traceparent (if any) parents this hop; the router calls carry ours.
    span = get_tracer().start_span(
        "pdmesh.gateway.request", context=extract_headers(request.headers),
        kind=SpanKind.SERVER,
        attributes={"http.route": endpoint, "gen_ai.request.model": served_model,
                    "gen_ai.operation.name": plan.formatter.operation,
                    "pdmesh.request_id": request_id_of(request)},
    )
    metadata = inject_metadata(ctx=trace.set_span_in_context(span))
    keep_alive_s = context.config.sse_keep_alive_interval if plan.stream else 0.0
    if keep_alive_s > 0:
        for r in plan.requests:  # the stream may start at acceptance (gateway/streaming.py)
            r.send_accepted = True
    gen = Generation(
        head=ResponseHead(id=plan.id, created=int(time.time()), model=served_model),
        n=plan.n, include_usage=plan.include_usage,
        calls=[context.client.generate(r, metadata=metadata) for r in plan.requests],
        formatter=plan.formatter, span=span, continuous_usage=plan.continuous_usage,
        prompt_tokens=prompt_tokens,
    )
    watch = DisconnectWatch(request, gen.close)
    metrics = context.metrics
    metrics.in_flight.labels(endpoint).inc()
    handed_over = False
    try:
        if not plan.stream:
            result = await until_disconnect(watch, _whole(gen))
            return result if result is not None else Response(status_code=CLIENT_CLOSED)
        iterators = [call.__aiter__() for call in gen.calls]
        firsts = await until_disconnect(watch, first_events(iterators))
        if firsts is None:
            return Response(status_code=CLIENT_CLOSED)
        handed_over = True
        events = sse_events(
            gen, iterators, firsts, done=lambda: _finished(metrics, gen, watch, endpoint))
        return sse_response(with_keep_alive(events, keep_alive_s) if keep_alive_s > 0
                            else events)
    finally:
        if not handed_over:
            _finished(metrics, gen, watch, endpoint)


async def _whole(gen: Generation) -> JSONResponse:
    """Every call read to its end, then answered at once."""
    outputs = Outputs(sequences={}, prompt_logprobs={}, usage=gen.usage)

    async def one(p: int, call: GenerateCall) -> None:
        async for resp in call:
            if resp.HasField("delta"):
                gen.saw_delta(resp.delta)
                outputs.sequences.setdefault(
                    p * gen.n + resp.delta.index, SequenceState()).add(resp.delta)
            elif resp.HasField("result"):
                gen.usage.add(resp.result.usage)
                outputs.prompt_logprobs[p] = list(resp.result.prompt_logprobs)

    await asyncio.gather(*(one(p, call) for p, call in enumerate(gen.calls)))
    failed = [s.finish for s in outputs.sequences.values()
              if s.finish is not None and s.finish.reason == common_pb2.FINISH_REASON_ERROR]
    if failed:
        raise generation_failed(failed[0].message)
    body = gen.formatter.whole(gen.head, outputs)
    gen.ok = True
    return JSONResponse(body.model_dump(mode="json"))


def _finished(metrics: GatewayMetrics, gen: Generation, watch: DisconnectWatch,
              endpoint: str) -> None:
    """The request's end, however it ended: its calls closed, its log line, its span ended,
    and (answered in full) its latencies and tokens counted."""
    watch.stop()
    gen.close()
    metrics.in_flight.labels(endpoint).dec()
    if watch.fired:
        metrics.disconnects.labels(endpoint).inc()
    logger.info("request_id=%s endpoint=%s ok=%s disconnected=%s", gen.head.id, endpoint,
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
        metrics.ttft.labels(endpoint).observe(gen.first_token_at - gen.started)
    metrics.e2e.labels(endpoint).observe(now - gen.started)
    metrics.prompt_tokens.inc(gen.usage.prompt_tokens)
    metrics.cached_prompt_tokens.inc(gen.usage.prompt_tokens_details.cached_tokens)
    metrics.generation_tokens.inc(gen.usage.completion_tokens)
