"""The request side of tool calling: `tools` / `tool_choice` / `parallel_tool_calls` → what
the router is asked for (the tools for the chat template, a structured-output constraint) and
how the output is read back (a `ToolPlan`).

vLLM's behaviour: tools without `tool_choice` mean `"auto"`, which needs
`--enable-auto-tool-choice --tool-call-parser P` and parses the model's free text with P;
`"required"` and a named function are enforced with structured outputs (the same
`StructuredOutput` path as `response_format`), so their output always parses; `"none"` parses
nothing (the tools still reach the template unless `--exclude-tools-when-tool-choice-none`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdmesh.gateway.chat_schemas import ChatCompletionRequest, ChatTool
from pdmesh.gateway.errors import GatewayError
from pdmesh.gateway.tool_parsers import (
    TOOL_PARSERS,
    JsonArrayToolParser,
    OutputStream,
    StreamEvents,
    ToolCallDelta,
    ToolParser,
    new_tool_call_id,
)
from pdmesh.v1 import common_pb2

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""A function without `parameters` takes none (OpenAI's reading)."""


@dataclass(frozen=True)
class ToolSettings:
    """The gateway's tool-calling flags (GatewayConfig)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False


class NamedCallStream:
    """`tool_choice` naming a function: the whole output is that call's arguments (constrained
    to its parameters' schema), so the call is announced at once and the text streams as its
    arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.num_calls = 0

    def feed(self, delta: str) -> StreamEvents:
        events = StreamEvents()
        if not self.num_calls:
            events.tool_calls.append(ToolCallDelta(0, new_tool_call_id(), self.name, ""))
            self.num_calls = 1
        if delta:
            events.tool_calls.append(ToolCallDelta(0, arguments=delta))
        return events

    def finish(self) -> StreamEvents:
        return self.feed("")


@dataclass(frozen=True)
class ToolPlan:
    """One chat request's tool calling: what goes to the router, and how to read the output."""

    tools_json: str  # the tools for the chat template as JSON; "" = none
    structured_output: common_pb2.StructuredOutput | None = None
    parser: ToolParser | None = None  # tool_choice "auto"
    named: str | None = None  # tool_choice naming a function
    required: bool = False  # tool_choice "required"
    parallel: bool = True  # parallel_tool_calls; false: at most one call in "auto"

    def stream(self) -> OutputStream | None:
        """A reader for one output sequence; None when the output is plain content."""
        if self.named is not None:
            return NamedCallStream(self.named)
        if self.required:
            return JsonArrayToolParser().stream()
        if self.parser is not None:
            return self.parser.stream(max_calls=None if self.parallel else 1)
        return None


def _bad(message: str, param: str = "tool_choice") -> GatewayError:
    return GatewayError(400, message, param=param)


def plan_tools(body: ChatCompletionRequest, settings: ToolSettings) -> ToolPlan | None:
    """The request's ToolPlan (None without tools); a GatewayError 400 naming the field for a
    request that cannot be served as asked."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise _bad("tool_choice needs tools: set tools, or leave tool_choice out")
        return None
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    names = [t.function.name for t in tools]
    tools_json = json.dumps([t.model_dump(exclude_none=True) for t in tools])
    if choice == "none":
        return ToolPlan("" if settings.exclude_tools_when_tool_choice_none else tools_json)
    if choice == "auto":
        if not settings.enable_auto_tool_choice or settings.tool_call_parser is None:
            raise _bad('"auto" tool choice (the default with tools) requires the server to run '
                       "with --enable-auto-tool-choice and --tool-call-parser; use "
                       'tool_choice "required", "none" or a named function otherwise')
        parameters = {t.function.name: t.function.parameters or EMPTY_PARAMETERS for t in tools}
        return ToolPlan(tools_json, parser=TOOL_PARSERS[settings.tool_call_parser](parameters),
                        parallel=body.parallel_tool_calls)
    if body.has_structured_output():
        raise _bad(f"tool_choice {_choice_name(choice)} is enforced with a structured output "
                   "and cannot be combined with response_format, structured_outputs or "
                   "guided_*")
    if choice == "required":
        schema = required_schema(tools, parallel=body.parallel_tool_calls)
        return ToolPlan(tools_json, _json_schema(schema), required=True)
    assert not isinstance(choice, str)
    name = choice.function.name
    if name not in names:
        raise _bad(f"tool_choice names function {name!r}, which is not in tools "
                   f"({', '.join(names)})")
    tool = tools[names.index(name)]
    return ToolPlan(tools_json, _json_schema(tool.function.parameters or EMPTY_PARAMETERS),
                    named=name)


def _choice_name(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def _json_schema(schema: dict[str, Any]) -> common_pb2.StructuredOutput:
    return common_pb2.StructuredOutput(json_schema=json.dumps(schema))


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """`tool_choice="required"`: an array of one or more `{name, parameters}` objects, each a
    call of one of the tools with arguments valid for it (at most one without parallel calls).
    Each tool's `$defs` move to the root, where its `#/$defs/...` references resolve."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        params = dict(tool.function.parameters or EMPTY_PARAMETERS)
        for key, value in (params.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise _bad(f"tools: $defs entry {key!r} differs between functions", "tools")
            defs[key] = value
        variants.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                           "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
