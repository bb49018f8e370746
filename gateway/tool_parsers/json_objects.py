"""Call objects one after another: Llama 3.x's JSON tool calls (`llama3_json`), and the JSON
array `tool_choice="required"` is constrained to."""

from __future__ import annotations

import json

from pdmesh.gateway.tool_parsers.stream import Scanner, Segment, ToolParser, call_of


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
            call = call_of(obj, self.args_keys)
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
