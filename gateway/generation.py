"""One HTTP generation request in flight: its router calls, how it is answered, and what it
has produced so far (usage, timings), which the metrics and the trace read when it ends."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from pdmesh.gateway.formatter import Formatter, ResponseHead
from pdmesh.gateway.router_client import GenerateCall
from pdmesh.gateway.schemas import UsageInfo
from pdmesh.v1 import common_pb2


@dataclass
class Generation:
    head: ResponseHead
    n: int
    include_usage: bool
    calls: list[GenerateCall]  # one per prompt
    formatter: Formatter
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
