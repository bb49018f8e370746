"""Tool-call parsers: a model's output text → content + tool calls (vLLM's `--tool-call-parser`).

One module per output convention (`hermes`, `json_objects`: llama3_json, `pythonic`,
`mistral`, `qwen3_xml`: qwen3_coder); `TOOL_PARSERS` maps the flag's names onto them. Every
parser is a streaming one (`stream.py`): `parser.stream()` is fed text deltas and answers
content deltas and tool-call deltas; a whole text is the same stream fed once (`collect`), so
a stream ends with the same calls and content as the whole text whatever its chunking.
"""

from __future__ import annotations

from pdmesh.gateway.tool_parsers.hermes import HermesToolParser
from pdmesh.gateway.tool_parsers.json_objects import JsonArrayToolParser, Llama3JsonToolParser
from pdmesh.gateway.tool_parsers.mistral import MistralToolParser
from pdmesh.gateway.tool_parsers.pythonic import Llama4PythonicToolParser, PythonicToolParser
from pdmesh.gateway.tool_parsers.qwen3_xml import Qwen3XmlAliasToolParser, Qwen3XmlToolParser
from pdmesh.gateway.tool_parsers.stream import (
    OutputStream,
    Scanner,
    StreamEvents,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    collect,
    gather,
    held_prefix,
    new_tool_call_id,
)

__all__ = [
    "TOOL_PARSERS", "HermesToolParser", "JsonArrayToolParser", "Llama3JsonToolParser",
    "Llama4PythonicToolParser", "MistralToolParser", "OutputStream", "PythonicToolParser",
    "Qwen3XmlToolParser",
    "Scanner", "StreamEvents", "ToolCall", "ToolCallDelta", "ToolCallStream", "ToolParser",
    "check_tool_flags", "collect", "gather", "held_prefix", "new_tool_call_id",
]

TOOL_PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (
    HermesToolParser, Llama3JsonToolParser, PythonicToolParser, Llama4PythonicToolParser,
    MistralToolParser, Qwen3XmlToolParser, Qwen3XmlAliasToolParser,
)}


def check_tool_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """The start-up check of `--enable-auto-tool-choice` / `--tool-call-parser` (gateway and
    `pdmesh serve`): a clear error instead of a 400 on every request later."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got "
                         f"{tool_call_parser!r}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{', '.join(TOOL_PARSERS)})")
