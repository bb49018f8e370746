"""hermes (Hermes 2 Pro, Qwen2.5, Qwen3): content first, then one `<tool_call>` JSON block per
call."""

from __future__ import annotations

import json

from pdmesh.gateway.tool_parsers.stream import (
    Scanner,
    Segment,
    ToolCall,
    ToolParser,
    call_of,
    held_prefix,
)


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
        return call_of(json.loads(body), ("arguments", "parameters"))
    except json.JSONDecodeError:
        return None


class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5 style: content first, then one `<tool_call>` JSON block per call (the
    last block may lack its closing tag)."""

    name = "hermes"

    def scanner(self) -> Scanner:
        return _HermesScanner()
