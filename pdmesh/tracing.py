"""OpenTelemetry tracing for every pdmesh process: set-up from OTEL_* variables, W3C propagation.

Off by default. `configure_tracing(service)` installs the SDK (a `TracerProvider` with a batch
processor and the OTLP exporter) only when the standard variables ask for it: an exporter in
`OTEL_TRACES_EXPORTER` other than `none`, or an OTLP endpoint
(`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), and not
`OTEL_SDK_DISABLED=true`. Otherwise nothing is installed: the API's no-op tracer hands out
non-recording spans (a few hundred nanoseconds each), and an incoming `traceparent` still passes
through unchanged, so a traced gateway in front of an untraced router keeps one trace.

Everything else (sampler, batch delays, exporter endpoint, headers, TLS, timeouts, resource
attributes) is read by the SDK itself from the standard variables.

Context crosses processes three ways, all W3C trace context:

* gRPC metadata: `inject_metadata()` on the client call, `extract_metadata(context)` in the
  servicer;
* HTTP headers (the gateway): `extract_headers(request.headers)`, then `inject_metadata()`
  towards the router inside the span started from it;
* the KV transfer control messages' `traceparent` string: `current_traceparent()` /
  `context_from_traceparent()`.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

logger = logging.getLogger(__name__)

TRACER_NAME = "pdmesh"
TRACEPARENT = "traceparent"
_TRACEPARENT_RE = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
_lock = threading.Lock()
_provider: Any = None  # the SDK TracerProvider this module installed, if any

__all__ = [
    "TRACEPARENT",
    "Span",
    "SpanKind",
    "configure_tracing",
    "context_from_traceparent",
    "current_traceparent",
    "extract_headers",
    "extract_metadata",
    "gen_ai_request_attributes",
    "gen_ai_response_attributes",
    "get_tracer",
    "inject_metadata",
    "mark_error",
    "monotonic_to_ns",
    "shutdown_tracing",
    "span_traceparent",
    "tracing_requested",
]


# -- set-up ----------------------------------------------------------------------------------------
def tracing_requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether the OTEL_* variables ask for traces to be exported."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = _exporter_names(env)
    if exporters:
        return exporters != ["none"]
    return bool(
        env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def _exporter_names(env: Mapping[str, str]) -> list[str]:
    raw = env.get("OTEL_TRACES_EXPORTER", "")
    return [name.strip().lower() for name in raw.split(",") if name.strip()]


def configure_tracing(service_name: str, env: Mapping[str, str] | None = None) -> bool:
    """Install the SDK for this process if OTEL_* asks for it; True when traces are exported.

    `service_name` (e.g. "pdmesh-router") is used unless OTEL_SERVICE_NAME is set. Raises
    ValueError naming the variable when the configuration cannot work. Idempotent.
    """
    global _provider
    env = os.environ if env is None else env
    if not tracing_requested(env):
        return False
    with _lock:
        if _provider is not None:
            return True
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        attributes = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
        provider = TracerProvider(resource=Resource.create(attributes))
        for name in _exporter_names(env) or ["otlp"]:
            if name != "none":
                provider.add_span_processor(BatchSpanProcessor(_make_exporter(name, env)))
        trace.set_tracer_provider(provider)
        _provider = provider
    logger.info("tracing on service=%s exporters=%s", service_name,
                ",".join(_exporter_names(env) or ["otlp"]))
    return True


def _make_exporter(name: str, env: Mapping[str, str]) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(out=sys.stderr)  # stdout carries the ready line
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter {name!r} "
                         "(use otlp, console or none)")
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol in ("http/protobuf", "http"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HTTPSpanExporter,
            )
        except ImportError:
            raise ValueError(
                "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf needs the package "
                "opentelemetry-exporter-otlp-proto-http; install it or use grpc"
            ) from None
        return HTTPSpanExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: unsupported protocol {protocol!r} "
                     "(use grpc or http/protobuf)")


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Flush spans still buffered and stop the exporter (call once, at process exit)."""
    global _provider
    with _lock:
        provider, _provider = _provider, None
    if provider is None:
        return
    try:
        provider.force_flush(int(timeout_s * 1000))
    finally:
        provider.shutdown()


def get_tracer(name: str = TRACER_NAME) -> trace.Tracer:
    return trace.get_tracer(name)


# -- propagation -----------------------------------------------------------------------------------
class _MetadataGetter:
    """Reads gRPC metadata ((key, value) pairs or grpc Metadatum objects) for the propagator."""

    def get(self, carrier: Iterable[Any], key: str) -> list[str] | None:
        values = []
        for item in carrier:
            k, v = (item.key, item.value) if hasattr(item, "key") else item
            if k.lower() == key:
                values.append(v.decode("ascii", "replace") if isinstance(v, bytes) else str(v))
        return values or None

    def keys(self, carrier: Iterable[Any]) -> list[str]:
        return [item.key if hasattr(item, "key") else item[0] for item in carrier]


_GETTER = _MetadataGetter()


def inject_metadata(
    metadata: Iterable[tuple[str, str]] = (), ctx: otel_context.Context | None = None
) -> tuple[tuple[str, str], ...]:
    """`metadata` plus the trace context of `ctx` (default: the current one) for a gRPC call.

    With no active span and tracing off this adds nothing.
    """
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return (*tuple(metadata), *carrier.items())


def extract_metadata(source: Any) -> otel_context.Context:
    """The remote parent carried by a servicer context's (or plain) invocation metadata."""
    metadata = source.invocation_metadata() if hasattr(source, "invocation_metadata") else source
    return propagate.extract(tuple(metadata or ()), getter=_GETTER)


def extract_headers(headers: Mapping[str, str]) -> otel_context.Context:
    """The remote parent in HTTP headers (any case-insensitive mapping, e.g. Starlette's)."""
    return propagate.extract({k.lower(): v for k, v in headers.items()})


def current_traceparent(ctx: otel_context.Context | None = None) -> str:
    """W3C `traceparent` of `ctx` (default: the current context); "" when there is none."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier.get(TRACEPARENT, "")


def span_traceparent(span: Span) -> str:
    """W3C `traceparent` naming `span` as the parent (for a string field such as the KV
    transfer control messages'); "" when the span carries no valid context."""
    return current_traceparent(trace.set_span_in_context(span))


def context_from_traceparent(traceparent: str) -> otel_context.Context | None:
    """The parent context described by a `traceparent` string; None if absent or malformed."""
    if not traceparent or not _TRACEPARENT_RE.fullmatch(traceparent.strip().lower()):
        return None
    return propagate.extract({TRACEPARENT: traceparent.strip().lower()})


# -- OpenTelemetry GenAI semantic-convention attributes ------------------------------------------
GEN_AI_OPERATION = "text_completion"
GEN_AI_PROVIDER = "pdmesh"


def gen_ai_request_attributes(
    model: str, params: Any, *, input_tokens: int | None = None, max_tokens: int | None = None
) -> dict[str, Any]:
    """`gen_ai.*` request attributes from a SamplingParams-like object (reads max_tokens,
    temperature, top_p, top_k, seed, n, stop when present); `max_tokens` overrides params'."""
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": GEN_AI_OPERATION,
        "gen_ai.provider.name": GEN_AI_PROVIDER,
        "gen_ai.request.model": model,
    }
    limit = max_tokens if max_tokens is not None else getattr(params, "max_tokens", None)
    if limit is not None:
        attrs["gen_ai.request.max_tokens"] = int(limit)
    for key, attr in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                      ("seed", "seed")):
        value = getattr(params, attr, None)
        if value is not None:
            attrs[f"gen_ai.request.{key}"] = value
    n = getattr(params, "n", 1) or 1
    if n != 1:
        attrs["gen_ai.request.choice.count"] = int(n)
    stop = getattr(params, "stop", None)
    if stop:
        attrs["gen_ai.request.stop_sequences"] = list(stop)
    if input_tokens is not None:
        attrs["gen_ai.usage.input_tokens"] = int(input_tokens)
    return attrs


def gen_ai_response_attributes(
    *, response_id: str, output_tokens: int, finish_reasons: Iterable[str],
    input_tokens: int | None = None,
) -> dict[str, Any]:
    """`gen_ai.*` response attributes; finish reasons as the OpenAI-style strings."""
    attrs: dict[str, Any] = {
        "gen_ai.response.id": response_id,
        "gen_ai.usage.output_tokens": int(output_tokens),
        "gen_ai.response.finish_reasons": [r for r in finish_reasons if r],
    }
    if input_tokens is not None:
        attrs["gen_ai.usage.input_tokens"] = int(input_tokens)
    return attrs


# -- small helpers for span bookkeeping -----------------------------------------------------------
def monotonic_to_ns(monotonic_s: float) -> int:
    """Wall-clock nanoseconds of a `time.monotonic()` reading (for spans timed after the fact)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def mark_error(span: Span, exc: BaseException | str) -> None:
    """Set the span's status to ERROR with a short description (and record an exception)."""
    if not span.is_recording():
        return
    if isinstance(exc, BaseException):
        span.record_exception(exc)
        description = f"{type(exc).__name__}: {exc}"
    else:
        description = exc
    span.set_status(Status(StatusCode.ERROR, description[:512]))
