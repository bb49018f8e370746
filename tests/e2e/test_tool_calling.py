"""Tool calling through the gateway, driven by the official `openai` client.

Two real meshes (`pdmesh serve`, one after the other): colocated, and 1 prefill + 1 decode with
local prefill off (the first token is sampled on the prefill instance under the grammar). Both
use SmolLM2's weights with the tool-aware chat template shipped with pdmesh, as the README
says: `--chat-template hermes --enable-auto-tool-choice --tool-call-parser hermes`. The
model's judgement is never tested: `tool_choice` "required" and named functions are enforced
by structured outputs, and the auto path gets an output forced into the hermes format by a
guided choice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from pdmesh.auth import TOKEN_ENV
from pdmesh.serve import Child, pdmesh_command

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

KV_MEMORY = "64MiB"
ENV = {**os.environ, TOKEN_ENV: "tool-calling-test-token"}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                      "parameters": TIME_PARAMS}},
]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER: Any = {"type": "function", "function": {"name": "get_weather"}}
MAX_TOKENS = 40


@dataclass
class Mesh:
    base_url: str  # http://host:port/v1


@pytest.fixture(scope="module", params=["colocated", "pd"])
def mesh(request: pytest.FixtureRequest) -> Iterator[Mesh]:
    shape = (["--colocated", "--num-decode", "1"] if request.param == "colocated" else
             ["--num-prefill", "1", "--num-decode", "1", "--local-prefill-threshold", "0"])
    serve = Child(f"serve-{request.param}", pdmesh_command(
        "serve", *shape, "--kv-cache-memory", KV_MEMORY, "--port", "0",
        "--chat-template", "hermes", "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes"), env=ENV)
    try:
        serve.wait_ready(timeout_s=240)
        url = next(p for p in serve.ready_line.split() if p.startswith("gateway="))
        yield Mesh(url.removeprefix("gateway="))
    finally:
        serve.terminate(grace_s=30)


@pytest.fixture()
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def _check_call(call: Any, name: str | None = None) -> None:
    assert call.type == "function"
    assert call.id.startswith("chatcmpl-tool-")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def _streamed(stream: Any) -> tuple[str, dict[int, dict[str, str]], str | None, list[Any]]:
    """(content, tool calls by index: id/name/arguments, finish reason, the tool-call deltas)."""
    content, calls, finish, deltas = "", {}, None, []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                deltas.append(d)
                entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += d.id or ""
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    return content, calls, finish, deltas


def test_named_tool_call(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice=WEATHER,
        max_tokens=MAX_TOKENS, temperature=0.0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], "get_weather")


def test_named_tool_call_streamed(client: openai.OpenAI) -> None:
    content, calls, finish, deltas = _streamed(client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice=WEATHER,
        max_tokens=MAX_TOKENS, temperature=0.0, stream=True))
    assert (content, finish, list(calls)) == ("", "tool_calls", [0])
    assert deltas[0].id and deltas[0].function.name == "get_weather"  # announced first
    assert all(d.id is None for d in deltas[1:])  # then argument pieces
    assert calls[0]["id"].startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_PARAMS)


def test_required_tool_call(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=0.0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0])


def test_required_tool_call_streamed(client: openai.OpenAI) -> None:
    content, calls, finish, _ = _streamed(client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=0.0, stream=True))
    assert (content, finish, list(calls)) == ("", "tool_calls", [0])
    assert calls[0]["name"] in PARAMS
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS[calls[0]["name"]])


HERMES_OUTPUT = ('Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n'
                 "</tool_call>")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_a_hermes_tool_call(client: openai.OpenAI, stream: bool) -> None:
    # The output is forced (a guided choice of one) so the parser, not the model, is tested.
    kwargs: Any = dict(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS,
                       temperature=0.0, extra_body={"guided_choice": [HERMES_OUTPUT]})
    if stream:
        content, calls, finish, _ = _streamed(
            client.chat.completions.create(**kwargs, stream=True))
        assert (content, finish) == ("Checking.\n", "tool_calls")
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            ("get_time", {"zone": 2})]
        return
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking.\n"
    assert choice.message.tool_calls is not None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"zone": 2})


def test_tool_choice_none_is_plain_content(client: openai.OpenAI) -> None:
    choice = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="none",
        max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"guided_choice": [HERMES_OUTPUT]}).choices[0]
    assert choice.message.content == HERMES_OUTPUT and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


HISTORY: list[Any] = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22 C"},
]


def test_tool_history_is_accepted_and_rendered(client: openai.OpenAI, mesh: Mesh) -> None:
    answer = client.chat.completions.create(model="smollm2", messages=HISTORY, tools=TOOLS,
                                            tool_choice="none", max_tokens=4)
    assert answer.choices[0].message.role == "assistant"
    root = mesh.base_url.removesuffix("/v1")
    ids = httpx.post(f"{root}/tokenize", json={"messages": HISTORY, "tools": TOOLS},
                     timeout=30)
    assert ids.status_code == 200, ids.text
    text = httpx.post(f"{root}/detokenize", json={"tokens": ids.json()["tokens"]},
                      timeout=30).json()["prompt"]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call>") in text
    assert "<tool_response>\nsunny, 22 C\n</tool_response>" in text


@pytest.mark.parametrize("kwargs,words", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "'nope', which is not in tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0]"),
])
def test_bad_tool_requests_are_400s(client: openai.OpenAI, kwargs: dict[str, Any],
                                    words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, **kwargs)
    assert words in str(info.value)
