"""The machinery every tool-call parser shares: a `Scanner` (one parser's per-stream state)
turns text into content and complete calls, and a `ToolCallStream` turns those into OpenAI's
content and `tool_calls` deltas. A call is announced only once it is complete and well-formed,
so whatever the chunking, a stream ends with the same calls and content as the whole text, and
text that does not parse stays content (never lost, never half-announced as a call)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCall:
    """One complete call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)


@dataclass(frozen=True)
class ToolCallDelta:
    """OpenAI's streamed `tool_calls[]` entry: the first for an index carries id, type and
    name (arguments ""); later ones carry argument text to append."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
        out: dict[str, Any] = {"index": self.index, "function": function}
        if self.id is not None:
            out.update(id=self.id, type="function")
        return out


@dataclass
class StreamEvents:
    """What one delta (or the end) of the output adds: reasoning text (gateway/reply.py), content
    text, then tool-call deltas."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning: str = ""


Segment = str | ToolCall
"""A scanner's output: content text, or a complete call."""
def call_of(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    """A well-formed call object → ToolCall (arguments normalized to compact JSON), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def held_prefix(text: str, token: str) -> int:
    """How many trailing characters of `text` could begin `token` (held back while streaming)."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


class Scanner:
    """Per-stream state of one parser: `scan` turns the text seen so far into segments,
    keeping back what later text could still change."""

    def scan(self, delta: str, final: bool) -> list[Segment]:
        raise NotImplementedError


class BlocksScanner(Scanner):
    """Content, then one tagged block per call, from `START` to `END` (hermes, qwen3_coder):
    text between blocks is dropped, as vLLM does; a block that does not parse stays content;
    at the end, an unclosed last block is parsed as it stands."""

    START = END = ""

    def __init__(self) -> None:
        self.buf = ""
        self.in_calls = False  # a block was seen: text outside blocks is no content

    def block_end(self) -> int:
        """Where the block `buf` starts with ends (past its `END`), or -1 while it has not."""
        end = self.buf.find(self.END, len(self.START))
        return -1 if end < 0 else end + len(self.END)

    def block_started(self) -> None:
        """`buf` now starts with a new block."""

    def parse(self, body: str) -> ToolCall | None:
        raise NotImplementedError

    def scan(self, delta: str, final: bool) -> list[Segment]:
        self.buf += delta
        out: list[Segment] = []
        while True:
            start = self.buf.find(self.START)
            if start < 0:
                keep = 0 if final else held_prefix(self.buf, self.START)
                if not self.in_calls:
                    out.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return [s for s in out if s != ""]
            if not self.in_calls:
                out.append(self.buf[:start])
                self.in_calls = True
            if start:
                self.buf = self.buf[start:]
                self.block_started()
            end = self.block_end()
            if end < 0 and not final:
                return [s for s in out if s != ""]
            raw = self.buf if end < 0 else self.buf[:end]
            body = raw[len(self.START):len(raw) - (0 if end < 0 else len(self.END))]
            self.buf = self.buf[len(raw):]
            self.block_started()
            out.append(self.parse(body) or raw)


class ToolCallStream:
    """Feeds a scanner and turns its segments into OpenAI deltas.

    Content that is only whitespace is held back until something else arrives: a model that
    writes "\\n" before its first tool call answers with calls and no content, streamed or not.
    With `max_calls` (`parallel_tool_calls: false` is 1), calls past it are dropped, as vLLM
    does: the model may still write several, the client is promised at most that many.
    """

    def __init__(self, scanner: Scanner, max_calls: int | None = None) -> None:
        self._scanner = scanner
        self._max_calls = max_calls
        self._held = ""
        self._content_started = False
        self.num_calls = 0

    def feed(self, delta: str) -> StreamEvents:
        return self._events(self._scanner.scan(delta, final=False), final=False)

    def finish(self) -> StreamEvents:
        return self._events(self._scanner.scan("", final=True), final=True)

    def _events(self, segments: list[Segment], final: bool) -> StreamEvents:
        out = StreamEvents()
        for seg in segments:
            if isinstance(seg, ToolCall):
                if self._max_calls is not None and self.num_calls >= self._max_calls:
                    continue
                out.tool_calls += [ToolCallDelta(self.num_calls, seg.id, seg.name, ""),
                                   ToolCallDelta(self.num_calls, arguments=seg.arguments)]
                self.num_calls += 1
            elif self._content_started:
                out.content += seg
            else:
                self._held += seg
                if self._held.strip():
                    out.content, self._held, self._content_started = self._held, "", True
        if final and self._held and not self.num_calls:
            out.content += self._held
            self._held = ""
        return out


class OutputStream(Protocol):
    """Reads one output sequence's text deltas into content and tool-call deltas (and, read as
    a reply, reasoning: gateway/reply.py)."""

    num_calls: int

    def feed(self, delta: str) -> StreamEvents: ...

    def finish(self) -> StreamEvents: ...


def gather(stream: OutputStream, pieces: Iterable[str]) -> tuple[str, str, list[ToolCall]]:
    """Run a stream over `pieces` to its end: (reasoning, content, calls)."""
    reasoning = content = ""
    calls: dict[int, ToolCall] = {}
    for events in [*(stream.feed(p) for p in pieces), stream.finish()]:
        reasoning += events.reasoning
        content += events.content
        for d in events.tool_calls:
            if d.id is not None:
                calls[d.index] = ToolCall(d.name or "", "", d.id)
            else:
                prev = calls[d.index]
                calls[d.index] = ToolCall(prev.name, prev.arguments + d.arguments, prev.id)
    return reasoning, content, [calls[i] for i in sorted(calls)]


def collect(stream: OutputStream, pieces: Iterable[str]) -> tuple[str | None, list[ToolCall]]:
    """Run a stream over `pieces` to its end: (content or None when there is none, calls)."""
    _, content, calls = gather(stream, pieces)
    has_content = bool(content) or not calls
    return (content if has_content else None), calls


class ToolParser:
    """A named output convention; `stream()` starts parsing one output sequence."""

    name = ""
    keeps_special_tokens = False
    """Its markers are special tokens, which the output's text must keep (vLLM's
    `skip_special_tokens=False` for a request with tools under this parser)."""

    def __init__(self, parameters: Mapping[str, Any] | None = None) -> None:
        self.parameters: Mapping[str, Any] = parameters or {}
        """Each offered function's parameters schema, by name: how a format whose argument
        values are raw text (qwen3_coder) reads them."""

    def stream(self, max_calls: int | None = None) -> ToolCallStream:
        return ToolCallStream(self.scanner(), max_calls)

    def scanner(self) -> Scanner:
        raise NotImplementedError
