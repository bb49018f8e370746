"""How a chat reply is read out of one output sequence: the reasoning split off first (when the
server runs a `--reasoning-parser` and the request thinks: gateway/reasoning_parsers.py), then
the content read for tool calls (gateway/tools.py's `ToolPlan`). Chat completions and
/v1/responses both read their output through a `ReplyPlan`, whole (`read_reply`) or streamed
(`ReplyStream`), so the two APIs split it the same way."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdmesh.gateway.chat_schemas import ChatCompletionRequest
from pdmesh.gateway.reasoning_parsers import REASONING_PARSERS, ReasoningParser, ReasoningStream
from pdmesh.gateway.tool_parsers import OutputStream, StreamEvents, ToolCall, gather
from pdmesh.gateway.tools import ToolPlan
from pdmesh.v1 import router_pb2


class ReplyStream:
    """Reads one output sequence's text deltas into reasoning, content and tool-call deltas
    (an `OutputStream`). Without `include_reasoning` the reasoning is split off and dropped."""

    def __init__(self, reasoning: ReasoningStream | None, tools: OutputStream | None,
                 include_reasoning: bool = True) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._include = include_reasoning

    @property
    def num_calls(self) -> int:
        return self._tools.num_calls if self._tools is not None else 0

    def feed(self, delta: str) -> StreamEvents:
        if self._reasoning is None:
            return self._read("", delta, final=False)
        split = self._reasoning.feed(delta)
        return self._read(split.reasoning, split.content, final=False)

    def finish(self) -> StreamEvents:
        if self._reasoning is None:
            return self._read("", "", final=True)
        split = self._reasoning.finish()
        return self._read(split.reasoning, split.content, final=True)

    def _read(self, reasoning: str, content: str, final: bool) -> StreamEvents:
        if self._tools is None:
            events = StreamEvents(content=content)
        elif not content and not final:
            events = StreamEvents()  # still thinking: a named call is announced after it
        else:
            events = self._tools.feed(content)
            if final:
                rest = self._tools.finish()
                events.content += rest.content
                events.tool_calls += rest.tool_calls
        if self._include:
            events.reasoning = reasoning
        return events


@dataclass(frozen=True)
class Reply:
    """A whole output, read: reasoning (None: none), content (None: none besides the reasoning
    or the calls) and tool calls."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ReplyPlan:
    """One request's reading of its output."""

    tools: ToolPlan | None = None
    reasoning: ReasoningParser | None = None  # None: no reasoning part (no parser, no thinking)
    include_reasoning: bool = True  # vLLM's request field: false drops the reasoning

    def stream(self) -> OutputStream | None:
        """A reader for one output sequence; None when the output is plain content."""
        tools = self.tools.stream() if self.tools is not None else None
        if self.reasoning is None:
            return tools
        return ReplyStream(self.reasoning.stream(), tools, self.include_reasoning)

    def read(self, text: str) -> Reply:
        """A whole output, read as the stream reads it."""
        stream = self.stream()
        if stream is None:
            return Reply(None, text, [])
        return read_reply(stream, [text], has_reasoning=self.reasoning is not None)


def read_reply(stream: OutputStream, pieces: Iterable[str], has_reasoning: bool = False) -> Reply:
    """Run a reader over `pieces` to its end. Content is None when it is empty and the output
    had reasoning or calls instead, as vLLM answers."""
    reasoning, content, calls = gather(stream, pieces)
    none_left = not content and (bool(calls) or has_reasoning)
    return Reply(reasoning or None, None if none_left else content, calls)


@dataclass(frozen=True)
class ReasoningSettings:
    """The gateway's reasoning flags (GatewayConfig): the parser, and the template variables
    every render gets (the router renders with the same `--default-chat-template-kwargs`)."""

    parser: str | None = None
    template_defaults: Mapping[str, Any] = field(default_factory=dict)

    def parser_for(self, template_kwargs: Mapping[str, Any] | None) -> ReasoningParser | None:
        """The parser that splits a request's output: the server's, when the request thinks
        under its template variables (the request's own over the server's defaults)."""
        if self.parser is None:
            return None
        parser = REASONING_PARSERS[self.parser]
        return parser if parser.thinks({**self.template_defaults, **(template_kwargs or {})}) \
            else None


NO_REASONING = ReasoningSettings()
"""No `--reasoning-parser`: outputs are read as content (and tool calls)."""


def plan_reply(body: ChatCompletionRequest, tools: ToolPlan | None,
               settings: ReasoningSettings, request: router_pb2.GenerateRequest) -> ReplyPlan:
    """How a chat request's output is read, and what that reading needs of the router call:
    - a thinking request's structured output (its `response_format`, or the one a required
      or named tool is enforced with) applies after the reasoning
      (`StructuredOutput.reasoning_end`), as vLLM constrains a reasoning model: otherwise the
      grammar would hold from the first token and the model could not think;
    - a tool parser whose markers are special tokens (mistral's `[TOOL_CALLS]`) needs them
      kept in the output's text (`skip_special_tokens` off, as vLLM turns it off)."""
    reasoning = settings.parser_for(body.chat_template_kwargs)
    if reasoning is not None and request.sampling.HasField("structured_output"):
        request.sampling.structured_output.reasoning_end = reasoning.grammar_after
    if tools is not None and tools.parser is not None and tools.parser.keeps_special_tokens:
        request.sampling.skip_special_tokens = False
    return ReplyPlan(tools, reasoning, body.include_reasoning)
