"""qwen3_coder (Qwen3-Coder, Qwen3.5): content, then one XML-style block per call,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text, read by the type its function's JSON schema gives it (the
request's `tools`): a string as written, an integer, number or boolean parsed, an object or
array as JSON (or a Python literal, never run), null from `null`/`None` where the schema allows
it; what does not read as its type stays a string, as does a parameter the schema does not
name. A value may contain `</parameter>` or `</function>` as text: only one followed by the
next parameter, `</function>` or the block's end closes it. A block that does not parse stays
content; text between blocks is dropped, as in hermes.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from typing import Any

from pdmesh.gateway.tool_parsers.stream import BlocksScanner, Scanner, ToolCall, ToolParser

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_STRING_TYPES = ("string", "str", "text", "enum")


def _schema_type(schema: Any) -> tuple[str, bool]:
    """(the value's type name, whether null is allowed) of a parameter's schema."""
    if not isinstance(schema, Mapping):
        return "string", False
    kind = schema.get("type")
    options = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(kind, list):
        options = [{"type": k} for k in kind]
        kind = None
    if kind is None and isinstance(options, list):
        types = [str(o.get("type")).lower() for o in options if isinstance(o, Mapping)]
        others = [t for t in types if t != "null"]
        return (others[0] if others else "string"), "null" in types
    return str(kind or "string").lower(), kind == "null"


def read_value(text: str, schema: Any) -> Any:
    """A parameter's raw text as its schema's type (the module doc's rules)."""
    kind, nullable = _schema_type(schema)
    if nullable and text.lower() in ("null", "none"):
        return None
    if kind in _STRING_TYPES:
        return text
    if text.lower() in ("null", "none"):
        return None
    try:
        if kind in ("integer", "int"):
            return int(text)
        if kind in ("number", "float"):
            number = float(text)
            return int(number) if number.is_integer() and "." not in text else number
        if kind in ("boolean", "bool"):
            return {"true": True, "false": False}[text.lower()]
        if kind in ("object", "array"):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                return ast.literal_eval(text)
    except (ValueError, KeyError, SyntaxError, TypeError, RecursionError, MemoryError):
        return text
    return text


def _closes(text: str, at: int, closers: tuple[str, ...]) -> bool:
    """Whether what follows position `at` (past whitespace) starts with one of `closers`, or
    is where the text ends (no copy of the text: a value may hold many candidates)."""
    while at < len(text) and text[at].isspace():
        at += 1
    return at == len(text) or text.startswith(closers, at)


def parse_block(body: str, parameters: Mapping[str, Any]) -> ToolCall | None:
    """The call in a block's body (between `<tool_call>` and `</tool_call>`), or None."""
    body = body.strip()
    if not body.startswith(FUNCTION):
        return None
    name_end = body.find(">")
    name = body[len(FUNCTION):name_end].strip() if name_end > 0 else ""
    if not name or "\n" in name:
        return None
    properties = (parameters.get(name) or {}).get("properties") or {}
    arguments: dict[str, Any] = {}
    pos = name_end + 1
    while True:
        rest = body[pos:].lstrip()
        pos = len(body) - len(rest)
        if rest.startswith(FUNCTION_END) and not rest[len(FUNCTION_END):].strip():
            break
        if not rest.startswith(PARAMETER):
            return None
        key_end = body.find(">", pos)
        if key_end < 0:
            return None
        key = body[pos + len(PARAMETER):key_end].strip()
        start = key_end + 1 + (body.startswith("\n", key_end + 1))
        end = body.find(PARAMETER_END, start)
        while end >= 0 and not _closes(body, end + len(PARAMETER_END),
                                       (PARAMETER, FUNCTION_END)):
            end = body.find(PARAMETER_END, end + 1)
        if not key or end < 0:
            return None
        value = body[start:end]
        value = value[:-1] if value.endswith("\n") else value
        arguments[key] = read_value(value, properties.get(key))
        pos = end + len(PARAMETER_END)
    try:
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError):
        return None


def _block_end(text: str, search: int) -> tuple[int, int]:
    """Where the block that `text` starts ends (the index past its `</tool_call>`, or -1 while
    it has not), and where to search from next time: its end is the first `</tool_call>` right
    after a `</function>`."""
    while (end := text.find(END, search)) >= 0:
        before = end
        while before > 0 and text[before - 1].isspace():
            before -= 1
        if text.endswith(FUNCTION_END, 0, before):
            return end + len(END), 0
        search = end + 1
    return -1, max(len(START), len(text) - len(END) + 1)


class _Qwen3XmlScanner(BlocksScanner):
    START, END = START, END

    def __init__(self, parameters: Mapping[str, Any]) -> None:
        super().__init__()
        self.parameters = parameters
        self.searched = len(START)  # the open block's text before this holds no end

    def block_started(self) -> None:
        self.searched = len(START)

    def block_end(self) -> int:
        end, self.searched = _block_end(self.buf, self.searched)
        return end

    def parse(self, body: str) -> ToolCall | None:
        return parse_block(body, self.parameters)


class Qwen3XmlToolParser(ToolParser):
    name = "qwen3_coder"

    def scanner(self) -> Scanner:
        return _Qwen3XmlScanner(self.parameters)


class Qwen3XmlAliasToolParser(Qwen3XmlToolParser):
    """vLLM's other name for the same format."""

    name = "qwen3_xml"
