"""hermes (Hermes 2 Pro, Qwen2.5, Qwen3): content first, then one `<tool_call>` JSON block per
call."""

from __future__ import annotations

import json

from pdmesh.gateway.tool_parsers.stream import BlocksScanner, Scanner, ToolCall, ToolParser, call_of


class _HermesScanner(BlocksScanner):
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, body: str) -> ToolCall | None:
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
