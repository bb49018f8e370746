"""The router's goodput: a finished request counts when it met every `--goodput` SLO, its ITL
being the longest gap between two deltas with tokens (a freeze the reader saw)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from pdmesh.metrics import router_metrics
from pdmesh.router import responses
from pdmesh.router.request import PreparedRequest
from pdmesh.router.responses import ResponseStream
from pdmesh.slo import parse_goodput
from pdmesh.v1 import common_pb2, router_pb2

pytestmark = pytest.mark.fast


class Clock:
    """The monotonic clock the stream reads, moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def stream_with_gaps(monkeypatch: pytest.MonkeyPatch, gaps_s: list[float],
                     slos: str) -> float:
    """A request whose first token comes 0.1 s in and each next one `gaps_s` later; the
    router's goodput counter afterwards."""
    clock = Clock()
    # The stream's module reads this clock; the real `time` module stays untouched.
    monkeypatch.setattr(responses, "time", SimpleNamespace(monotonic=clock.monotonic))
    registry = CollectorRegistry()
    metrics = router_metrics(registry)
    req = PreparedRequest("r", [1, 2, 3], common_pb2.SamplingParams(), 1, 16, "", 0, True,
                          received_at=clock.now, deadline=clock.now + 60)
    sent: list[router_pb2.GenerateResponse] = []

    async def send(msg: router_pb2.GenerateResponse) -> None:
        sent.append(msg)

    stream = ResponseStream(req, send, metrics, parse_goodput(slos.split(",")))

    async def run() -> None:
        clock.now += 0.1
        await stream.emit(common_pb2.SequenceDelta(index=0, token_ids=[5]))
        for gap in gaps_s:
            clock.now += gap
            await stream.emit(common_pb2.SequenceDelta(index=0, token_ids=[6]))
        await stream.finish(common_pb2.Usage(prompt_tokens=3,
                                             completion_tokens=1 + len(gaps_s)),
                            [], router_pb2.ServedBy())

    asyncio.run(run())
    assert sent[-1].HasField("result")
    return registry.get_sample_value("pdmesh:router_goodput_requests_total") or 0.0


def test_a_smooth_stream_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    assert stream_with_gaps(monkeypatch, [0.05] * 10, "ttft:500,itl:200") == 1


def test_one_freeze_does_not_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # The same mean time per token as a smooth stream, but one 550 ms freeze.
    assert stream_with_gaps(monkeypatch, [0.0] * 9 + [0.55], "ttft:500,itl:200") == 0
    assert stream_with_gaps(monkeypatch, [0.0] * 9 + [0.55], "ttft:500,tpot:200") == 1


def test_a_slow_first_token_does_not_count(monkeypatch: pytest.MonkeyPatch) -> None:
    assert stream_with_gaps(monkeypatch, [0.05] * 3, "ttft:50") == 0
