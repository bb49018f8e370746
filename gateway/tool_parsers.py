"""Tool-call parsers: a model's output text → content + tool calls (vLLM's `--tool-call-parser`).

One small class per output convention; `TOOL_PARSERS` maps the flag's names onto them. Every
parser is a streaming one: `parser.stream()` is fed text deltas and answers content deltas and
tool-call deltas; a whole text is the same stream fed once (`collect`). A call is announced
only once its JSON is complete and well-formed, so whatever the chunking, a stream ends with the
same calls and content as the whole text, and text that does not parse stays content (it is
never lost, and never half-announced as a call).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
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


def _call_of(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
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

    def stream(self, max_calls: int | None = None) -> ToolCallStream:
        return ToolCallStream(self.scanner(), max_calls)

    def scanner(self) -> Scanner:
        raise NotImplementedError


# -- hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> ---------------------------
class _HermesScanner(Scanner):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buf = ""
        self.in_calls = False  # a <tool_call> was seen: text outside blocks is no content

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
            self.buf = self.buf[start:]  # text between blocks is dropped, as vLLM does
            end = self.buf.find(self.END, len(self.START))
            if end < 0 and not final:
                return [s for s in out if s != ""]
            raw = self.buf if end < 0 else self.buf[:end + len(self.END)]
            body = raw[len(self.START):len(raw) - (0 if end < 0 else len(self.END))]
            self.buf = self.buf[len(raw):]
            out.append(_parse_hermes(body) or raw)


def _parse_hermes(body: str) -> ToolCall | None:
    try:
        return _call_of(json.loads(body), ("arguments", "parameters"))
    except json.JSONDecodeError:
        return None


class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5 style: content first, then one `<tool_call>` JSON block per call (the
    last block may lack its closing tag)."""

    name = "hermes"

    def scanner(self) -> Scanner:
        return _HermesScanner()


# -- JSON objects one after another: llama3_json, and the `required` array ----------------------
class _JsonObjectsScanner(Scanner):
    """Call objects one after another, each after optional `skip` separators; the first thing
    that is not a well-formed call object ends parsing and, with all after it, is content."""

    def __init__(self, opener: str, separators: str, args_keys: tuple[str, ...],
                 prefix_tag: str = "") -> None:
        self.buf = ""
        self.opener, self.separators, self.args_keys = opener, separators, args_keys
        self.prefix_tag = prefix_tag
        self.mode = "undecided"  # → "calls" or "content"

    def scan(self, delta: str, final: bool) -> list[Segment]:
        self.buf += delta
        if self.mode == "undecided":
            head = self.buf.lstrip()
            if head.startswith(self.opener) or (self.prefix_tag and head.startswith(
                    self.prefix_tag)):
                self.mode = "calls"
            elif not final and (not head or (self.prefix_tag.startswith(head))
                                or self.opener.startswith(head)):
                return []
            else:
                self.mode = "content"
        if self.mode == "content":
            text, self.buf = self.buf, ""
            return [text] if text else []
        return self._calls(final)

    def _calls(self, final: bool) -> list[Segment]:
        out: list[Segment] = []
        decoder = json.JSONDecoder()
        while True:
            pos = 0
            if self.prefix_tag and self.buf.lstrip().startswith(self.prefix_tag):
                pos = self.buf.index(self.prefix_tag) + len(self.prefix_tag)
            while pos < len(self.buf) and (self.buf[pos].isspace()
                                           or self.buf[pos] in self.separators):
                pos += 1
            rest = self.buf[pos:]
            if not rest.strip() or (not final and self.prefix_tag.startswith(rest.strip())):
                if final:
                    self.buf = ""  # separators and whitespace at the end
                return out
            if not rest.startswith("{"):
                self.mode = "content"
                text, self.buf = self.buf, ""
                return [*out, text]
            try:
                obj, end = decoder.raw_decode(rest)
            except json.JSONDecodeError:
                if not final:
                    return out  # incomplete (or malformed: known at the end)
                self.mode = "content"
                text, self.buf = self.buf, ""
                return [*out, text]
            call = _call_of(obj, self.args_keys)
            if call is None:
                self.mode = "content"
                text, self.buf = self.buf, ""
                return [*out, text]
            out.append(call)
            self.buf = rest[end:]


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` objects (or
    `arguments`), optionally after `<|python_tag|>`, several separated by `;`. Output that does
    not start with one is plain content."""

    name = "llama3_json"

    def scanner(self) -> Scanner:
        return _JsonObjectsScanner("{", ";", ("parameters", "arguments"),
                                   prefix_tag="<|python_tag|>")


class JsonArrayToolParser(ToolParser):
    """The output `tool_choice="required"` is constrained to (gateway/tools.py): a JSON array
    of `{"name": ..., "parameters": {...}}`. Not a `--tool-call-parser` choice."""

    name = "json_array"

    def scanner(self) -> Scanner:
        return _JsonObjectsScanner("[", "[,]", ("parameters",))


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}


def check_tool_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """The start-up check of `--enable-auto-tool-choice` / `--tool-call-parser` (gateway and
    `pdmesh serve`): a clear error instead of a 400 on every request later."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got "
                         f"{tool_call_parser!r}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{', '.join(TOOL_PARSERS)})")
