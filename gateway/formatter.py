"""The interface of a response formatter: how one API kind answers a generation request, whole
or streamed (Server-Sent Events).

The gateway's generation flow (gateway/serving.py, gateway/streaming.py) is the same for every
kind: router calls in, `SequenceDelta`s out. What differs is the answer's shape, and that is a
`Formatter`'s alone: one module per kind (completion_formatter.py, chat_formatter.py), so
another OpenAI API (e.g. /v1/responses) is one more formatter, a route and its translation
(gateway/translate.py). A formatter is made per request: a streamed answer keeps per-choice
state in it (text offsets, tool-call readers).

Choice indices follow OpenAI's numbering: prompt index × n + sequence index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from pdmesh.gateway.openai_format import SequenceState
from pdmesh.gateway.schemas import UsageInfo
from pdmesh.v1 import common_pb2

Choice = dict[str, Any]
"""One streamed choice as JSON, sent in a chunk of its own."""


@dataclass(frozen=True)
class ResponseHead:
    """What a response and each of its chunks carry besides choices."""

    id: str
    created: int
    model: str


@dataclass
class Outputs:
    """Everything a whole response is made of, once every router call has ended."""

    sequences: dict[int, SequenceState]  # by choice index
    prompt_logprobs: dict[int, list[common_pb2.TokenLogprob]]  # by prompt index
    usage: UsageInfo


@dataclass
class StreamedDelta:
    """What one delta of a streamed choice sends, and whether its sequence failed (which ends
    the stream with an error event instead of the usage)."""

    choices: list[Choice] = field(default_factory=list)
    failed: bool = False


def sequence_failed(delta: common_pb2.SequenceDelta) -> bool:
    return delta.finish.reason == common_pb2.FINISH_REASON_ERROR


class Formatter(Protocol):
    """One API kind's answer to one generation request."""

    operation: str
    """The kind, as the trace names it (`gen_ai.operation.name`)."""
    chunk_object: str
    """The `object` of the streamed chunks."""

    def whole(self, head: ResponseHead, outputs: Outputs) -> BaseModel:
        """The unstreamed response."""

    def opening(self) -> list[Choice]:
        """The choices streamed before any output."""

    def prompt_started(
        self, p: int, prompt_logprobs: list[common_pb2.TokenLogprob] | None
    ) -> list[Choice]:
        """The choices streamed when prompt `p`'s first event arrives (the router sends its
        prompt logprobs first, when they were asked for)."""

    def delta(self, index: int, delta: common_pb2.SequenceDelta) -> StreamedDelta:
        """What a delta with output (text, logprobs or a finish) of choice `index` streams."""
