"""Tool-call parsing (gateway/tool_parsers.py) and the request side of tool calling
(gateway/tools.py): whole texts, every chunking of a stream, malformed output, and the JSON
schemas that enforce `tool_choice="required"` / a named function."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from pdmesh.gateway.chat_schemas import ChatCompletionRequest
from pdmesh.gateway.config import GatewayConfig
from pdmesh.gateway.errors import GatewayError
from pdmesh.gateway.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    JsonArrayToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    Qwen3XmlToolParser,
    ToolParser,
    check_tool_flags,
    collect,
)
from pdmesh.gateway.tools import ToolSettings, plan_tools, required_schema
from pdmesh.gateway.translate import chat_plan

pytestmark = pytest.mark.fast

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}},
]
HERMES_TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": 2}}</tool_call>'
)
LLAMA_TEXT = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
              '{"name": "get_time", "parameters": {"zone": 1}}')
PYTHONIC_TEXT = '[get_weather(city="Paris, [FR]"), get_time(zone=2, dst=True, at=None)]'
MISTRAL_V3_TEXT = ('Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
                   '"Paris"}}, {"name": "get_time", "arguments": {"zone": 2}}]')
MISTRAL_V11_TEXT = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]'
                    '{"zone": 2}')
TWO_CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": 2})]
QWEN3_XML_TEXT = ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                  "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                  "<parameter=zone>\n2\n</parameter>\n</function>\n</tool_call>")
QWEN3_PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def whole(parser: ToolParser, text: str) -> tuple[str | None, list[tuple[str, dict[str, Any]]]]:
    content, calls = collect(parser.stream(), [text])
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, Any]]]:
    content, calls = collect(parser.stream(), pieces)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_whole_text() -> None:
    content, calls = whole(HermesToolParser(), HERMES_TEXT)
    assert content == "Let me check.\n"
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": 2})]


def test_llama3_json_whole_text() -> None:
    content, calls = whole(Llama3JsonToolParser(), LLAMA_TEXT)
    assert content is None
    assert calls == [("get_weather", {"city": "Rome"}), ("get_time", {"zone": 1})]
    # Without the python tag, and with `arguments` instead of `parameters`.
    assert whole(Llama3JsonToolParser(), ' {"name": "f", "arguments": {}}') == (None, [("f", {})])


def test_pythonic_whole_text() -> None:
    assert whole(PythonicToolParser(), PYTHONIC_TEXT) == (None, [
        ("get_weather", {"city": "Paris, [FR]"}),
        ("get_time", {"zone": 2, "dst": True, "at": None})])
    wrapped = '<|python_start|>[get_time(zone=2)]<|python_end|>'
    assert whole(PythonicToolParser(), wrapped) == (None, [("get_time", {"zone": 2})])
    assert whole(PythonicToolParser(), "[f()] and then some words") == (
        " and then some words", [("f", {})])


@pytest.mark.parametrize("text", [
    "Plain answer [with a bracket]", "[1, 2]", "[f(1)]", "[f(x=y)]", "[f(x={1, 2})]",
    "[f(**kw)]", "[obj.f(x=1)]", "[f(x=1)", "[]", "[a]" * 20_000,
])
def test_pythonic_that_is_no_call_list_is_content(text: str) -> None:
    assert whole(PythonicToolParser(), text) == (text, [])


def test_mistral_whole_texts_and_ids() -> None:
    assert whole(MistralToolParser(), MISTRAL_V3_TEXT) == ("Checking.", TWO_CALLS)
    assert whole(MistralToolParser(), MISTRAL_V11_TEXT) == (None, TWO_CALLS)
    _, calls = collect(MistralToolParser().stream(), [MISTRAL_V11_TEXT])
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)  # Mistral's templates' rule
    bad = 'Hm.[TOOL_CALLS] [{"name": "f", "arguments": {oops}}]'
    assert whole(MistralToolParser(), bad) == (bad, [])
    after = '[TOOL_CALLS]get_time[ARGS]{"zone": 2} and some words'
    assert whole(MistralToolParser(), after) == (" and some words", [("get_time", {"zone": 2})])


def test_qwen3_coder_reads_values_by_their_schema_type() -> None:
    auto = plan_tools(_chat(tools=TOOLS), ToolSettings(True, "qwen3_coder"))
    assert auto is not None and auto.parser is not None
    assert auto.parser.parameters == QWEN3_PARAMETERS  # the request's tools, by name
    parser = Qwen3XmlToolParser(QWEN3_PARAMETERS)
    assert whole(parser, QWEN3_XML_TEXT) == ("Let me look.\n", TWO_CALLS)
    schema = {"f": {"type": "object", "properties": {
        "n": {"type": "number"}, "flag": {"type": "boolean"}, "tags": {"type": "array"},
        "opt": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "code": {"type": "string"},
        "bad": {"type": "integer"}}}}
    code = "if a:\n    x = '</parameter>'\n"
    text = ("<tool_call>\n<function=f>\n<parameter=n>\n2.5\n</parameter>\n"
            "<parameter=flag>\nTrue\n</parameter>\n<parameter=tags>\n['a', 'b']\n</parameter>\n"
            "<parameter=opt>\nNone\n</parameter>\n<parameter=code>\n" + code +
            "\n</parameter>\n<parameter=bad>\nmany\n</parameter>\n<parameter=extra>\n7\n"
            "</parameter>\n</function>\n</tool_call>")
    assert whole(Qwen3XmlToolParser(schema), text) == (None, [("f", {
        "n": 2.5, "flag": True, "tags": ["a", "b"], "opt": None, "code": code, "bad": "many",
        "extra": "7"})])


def test_qwen3_coder_values_may_hold_the_closing_tags() -> None:
    value = "a </parameter> b </function> c </tool_call>\n" * 2_000
    text = (f"<tool_call>\n<function=f>\n<parameter=x>\n{value}\n</parameter>\n</function>\n"
            "</tool_call>")
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]  # token-sized deltas
    assert streamed(Qwen3XmlToolParser(), pieces) == (None, [("f", {"x": value})])


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</function>\n</tool_call>",  # unclosed
    "<tool_call>\n<function=f>\njunk\n</function>\n</tool_call>",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
])
def test_qwen3_coder_malformed_blocks_stay_content(text: str) -> None:
    assert whole(Qwen3XmlToolParser(QWEN3_PARAMETERS), text) == (text, [])


@pytest.mark.parametrize("parser,text", [
    (HermesToolParser(), HERMES_TEXT),
    (Qwen3XmlToolParser(QWEN3_PARAMETERS), QWEN3_XML_TEXT),
    (Llama3JsonToolParser(), LLAMA_TEXT),
    (PythonicToolParser(), PYTHONIC_TEXT),
    (PythonicToolParser(), "[f(a=1)] tail [g(b=2)]"),
    (PythonicToolParser(), "Plain [text] here"),
    (PythonicToolParser(), '[f(s="a ] \\" [ b", t=[1, (2, 3)])] after'),
    (MistralToolParser(), MISTRAL_V3_TEXT),
    (MistralToolParser(), MISTRAL_V11_TEXT),
    (MistralToolParser(), 'a [TOOL_ b [TOOL_CALLS]f[ARGS]{"x": [1]} c'),
    (MistralToolParser(), '[TOOL_CALLS] [{"name": "f", "arguments": {oops}}]'),
    (HermesToolParser(), "no tools here, just <tool text"),
    (Llama3JsonToolParser(), "Plain answer {not json}"),
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": {"a": [1, 2]}'),  # unterminated
    (HermesToolParser(), 'x <tool_call>{"name": "f", "arguments": {oops}}</tool_call>'),
    (JsonArrayToolParser(), '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
                            '{"name": "get_time", "parameters": {"zone": 3}}]'),
])
def test_every_two_way_split_gives_the_whole_texts_result(parser: ToolParser, text: str) -> None:
    expected = whole(parser, text)
    for cut in range(len(text) + 1):
        assert streamed(parser, [text[:cut], text[cut:]]) == expected, cut
    assert streamed(parser, list(text)) == expected  # one character at a time


def test_stream_announces_a_call_before_its_arguments() -> None:
    stream = HermesToolParser().stream()
    first = stream.feed("Sure. <tool_")
    assert first.content == "Sure. " and not first.tool_calls  # "<tool_" is held back
    events = stream.feed('call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    header, args = events.tool_calls
    assert (header.index, header.name, header.arguments) == (0, "get_weather", "")
    assert header.id is not None and header.id.startswith("chatcmpl-tool-")
    assert (args.index, args.id, args.name) == (0, None, None)
    assert json.loads(args.arguments) == {"city": "Oslo"}
    assert stream.finish().content == ""


@pytest.mark.parametrize("parser,text", [
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": {bad json}}</tool_call>'),
    (HermesToolParser(), '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    (Llama3JsonToolParser(), '{"name": "f", "parameters": {"a": 1'),  # cut off
    (Llama3JsonToolParser(), '{"no_name": 1}'),
])
def test_malformed_json_stays_content(parser: ToolParser, text: str) -> None:
    assert whole(parser, text) == (text, [])


def test_registry_and_flag_checks() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "pythonic", "llama4_pythonic",
                                 "mistral", "qwen3_coder", "qwen3_xml"}
    check_tool_flags(True, "hermes")
    check_tool_flags(False, None)
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        check_tool_flags(True, None)
    with pytest.raises(ValueError, match="hermes, llama3_json, pythonic"):
        check_tool_flags(True, "nope")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        GatewayConfig(enable_auto_tool_choice=True)


# -- tool_choice -> what the request asks of the router -------------------------------------
def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


AUTO = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
NO_AUTO = ToolSettings()


def test_named_choice_constrains_to_that_functions_parameters() -> None:
    plan = plan_tools(_chat(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_time"}}), NO_AUTO)
    assert plan is not None and plan.named == "get_time"
    assert json.loads(plan.structured_output.json_schema) == TOOLS[1]["function"]["parameters"]
    assert json.loads(plan.tools_json) == TOOLS


def test_required_schema_accepts_calls_and_refuses_others() -> None:
    schema = required_schema(_chat(tools=TOOLS).tools or [], parallel=True)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "x"}},
                         {"name": "get_time", "parameters": {"zone": 1}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"zone": 1}}],
                [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema(_chat(tools=TOOLS).tools or [], parallel=False)
    assert single["maxItems"] == 1
    plan = plan_tools(_chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
                      NO_AUTO)
    assert plan is not None and json.loads(plan.structured_output.json_schema) == single


def test_defs_of_every_tool_are_hoisted_to_the_root() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
        "$defs": {"P": {"type": "integer"}}}}}
    schema = required_schema(_chat(tools=[tool]).tools or [], parallel=True)
    assert schema["$defs"] == {"P": {"type": "integer"}}
    jsonschema.validate([{"name": "f", "parameters": {"p": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": "x"}}], schema)


def test_a_parser_reading_special_tokens_keeps_them_in_the_text() -> None:
    """mistral's `[TOOL_CALLS]` is a special token: the request's output keeps it."""
    mistral = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="mistral")
    sampling = chat_plan(_chat(tools=TOOLS), "r", mistral).requests[0].sampling
    assert sampling.HasField("skip_special_tokens") and not sampling.skip_special_tokens
    for request in (_chat(tools=TOOLS), _chat()):
        sampling = chat_plan(request, "r", AUTO).requests[0].sampling
        assert not sampling.HasField("skip_special_tokens")
    assert not chat_plan(_chat(), "r", mistral).requests[0].sampling.HasField(
        "skip_special_tokens")


def test_auto_none_and_no_tools() -> None:
    assert plan_tools(_chat(), NO_AUTO) is None
    auto = plan_tools(_chat(tools=TOOLS), AUTO)  # tools without tool_choice: auto, as vLLM
    assert auto is not None and auto.parser is not None and auto.structured_output is None
    none = plan_tools(_chat(tools=TOOLS, tool_choice="none"), NO_AUTO)
    assert none is not None and none.parser is None and none.tools_json  # still templated
    hidden = plan_tools(_chat(tools=TOOLS, tool_choice="none"),
                        ToolSettings(exclude_tools_when_tool_choice_none=True))
    assert hidden is not None and hidden.tools_json == ""


@pytest.mark.parametrize("fields,param,words", [
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice",
     "structured output"),
])
def test_bad_tool_requests_are_400s_naming_the_field(
    fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(GatewayError) as info:
        plan_tools(_chat(**fields), NO_AUTO)
    assert info.value.status == 400 and info.value.param == param
    assert words in info.value.message


def test_auto_without_parallel_tool_calls_returns_only_the_first_call() -> None:
    plan = plan_tools(_chat(tools=TOOLS, parallel_tool_calls=False), AUTO)
    assert plan is not None and plan.parser is not None
    for pieces in ([HERMES_TEXT], list(HERMES_TEXT)):  # whole, and one character at a time
        stream = plan.stream()
        assert stream is not None
        content, calls = collect(stream, pieces)
        assert content == "Let me check.\n"
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})]
    parallel = plan_tools(_chat(tools=TOOLS), AUTO)
    assert parallel is not None
    stream = parallel.stream()
    assert stream is not None and len(collect(stream, [HERMES_TEXT])[1]) == 2
