"""pdmesh.tracing: OTEL_* switches, W3C propagation helpers, GenAI attributes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.tracing import (
    context_from_traceparent,
    current_traceparent,
    extract_headers,
    extract_metadata,
    gen_ai_request_attributes,
    inject_metadata,
    span_traceparent,
    tracing_requested,
)

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.fast
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False),
    ],
)
def test_tracing_is_off_unless_the_otel_variables_ask(env: dict, expected: bool) -> None:
    assert tracing_requested(env) is expected


@pytest.mark.fast
def test_a_span_context_round_trips_through_grpc_metadata() -> None:
    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("parent") as span:
        metadata = inject_metadata((("x-request-id", "r1"),))
        sc = span.get_span_context()
    assert metadata[0] == ("x-request-id", "r1")
    assert dict(metadata)["traceparent"].startswith(f"00-{sc.trace_id:032x}-{sc.span_id:016x}-")
    extracted = trace.get_current_span(extract_metadata(metadata)).get_span_context()
    assert (extracted.trace_id, extracted.span_id, extracted.is_remote) == (
        sc.trace_id, sc.span_id, True)


@pytest.mark.fast
def test_headers_and_strings_carry_the_same_context() -> None:
    from_headers = trace.get_current_span(extract_headers({"TraceParent": TP}))
    assert f"{from_headers.get_span_context().trace_id:032x}" == TP.split("-")[1]
    ctx = context_from_traceparent(TP)
    assert ctx is not None and current_traceparent(ctx) == TP
    for bad in ("", "garbage", "00-" + "0" * 32 + "-b7ad6b7169203331-01", TP[:-3]):
        assert context_from_traceparent(bad) is None


@pytest.mark.fast
def test_without_the_sdk_an_incoming_trace_passes_through() -> None:
    """The API's no-op tracer keeps the remote parent, so an untraced hop keeps one trace."""
    noop = trace.NoOpTracer()
    span = noop.start_span("hop", context=context_from_traceparent(TP))
    assert not span.is_recording()
    assert span_traceparent(span) == TP
    assert span_traceparent(noop.start_span("root")) == ""
    assert inject_metadata(ctx=trace.set_span_in_context(noop.start_span("root"))) == ()


@pytest.mark.fast
def test_gen_ai_request_attributes_follow_the_semantic_conventions() -> None:
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=5, max_tokens=7, n=2, seed=3,
                            stop=["\n"])
    attrs = gen_ai_request_attributes("smollm2", params, input_tokens=11)
    assert attrs["gen_ai.request.model"] == "smollm2"
    assert attrs["gen_ai.request.max_tokens"] == 7
    assert attrs["gen_ai.request.temperature"] == 0.5
    assert attrs["gen_ai.request.top_p"] == 0.9
    assert attrs["gen_ai.request.top_k"] == 5
    assert attrs["gen_ai.request.seed"] == 3
    assert attrs["gen_ai.request.choice.count"] == 2
    assert attrs["gen_ai.request.stop_sequences"] == ["\n"]
    assert attrs["gen_ai.usage.input_tokens"] == 11
    assert gen_ai_request_attributes("m", params, max_tokens=100)["gen_ai.request.max_tokens"] \
        == 100


def _run(env: dict[str, str], code: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, text=True,
                          capture_output=True, timeout=60, check=False)


@pytest.mark.processes
def test_configure_installs_the_sdk_only_when_asked() -> None:
    code = (
        "from opentelemetry import trace\n"
        "from pdmesh.tracing import configure_tracing, get_tracer, shutdown_tracing\n"
        "print('on' if configure_tracing('pdmesh-test') else 'off')\n"
        "with get_tracer().start_as_current_span('pdmesh.unit') as s:\n"
        "    print('recording' if s.is_recording() else 'noop')\n"
        "shutdown_tracing()\n"
    )
    off = _run({}, code)
    assert off.stdout.split() == ["off", "noop"], off.stderr
    on = _run({"OTEL_TRACES_EXPORTER": "console"}, code)
    assert on.stdout.split() == ["on", "recording"], on.stderr
    assert '"pdmesh.unit"' in on.stderr and '"pdmesh-test"' in on.stderr  # console -> stderr
    bad = _run({"OTEL_TRACES_EXPORTER": "zipkin"}, code)
    assert bad.returncode != 0 and "OTEL_TRACES_EXPORTER" in bad.stderr
