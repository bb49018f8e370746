"""/v1/responses on a real mesh, driven by the official `openai` client's `responses.create`.

One colocated mesh (`pdmesh serve`, the cheapest shape: the Responses route differs from chat
only in the gateway, before and after the same router Generate call), started for tool calling
as tests/e2e/test_tool_calling.py starts its own (`--chat-template hermes
--enable-auto-tool-choice --tool-call-parser hermes`). A greedy response must say exactly what
/v1/chat/completions says for the same conversation, whole and streamed, `text.format` must
constrain the output as chat's `response_format` does, and a named function or `"required"`
must come back as a function_call item whose arguments follow the function's parameters (the
structured output forces them: the model's judgement is never tested), after which the call and
its output sent back as input items get a message. Output logprobs (`include`) list one entry
per output token, the tokens chat's `logprobs.content` lists, whole and streamed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion

from pdmesh.auth import TOKEN_ENV
from pdmesh.serve import Child, pdmesh_command
from tests.e2e.test_tool_calling import TIME_PARAMS, WEATHER_PARAMS  # the same two tools

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

KV_MEMORY = "64MiB"
ENV = {**os.environ, TOKEN_ENV: "responses-api-test-token"}
MODEL = "smollm2"
INSTRUCTIONS = "You are a helpful assistant."
QUESTION = "Name three colors."
MAX_TOKENS = 16
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [  # the Responses API's flat function tools
    {"type": "function", "name": "get_weather", "description": "Current weather",
     "parameters": WEATHER_PARAMS},
    {"type": "function", "name": "get_time", "description": "Local time",
     "parameters": TIME_PARAMS},
]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    serve = Child("serve-responses", pdmesh_command(
        "serve", "--colocated", "--num-decode", "1", "--kv-cache-memory", KV_MEMORY,
        "--port", "0", "--chat-template", "hermes", "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes"), env=ENV)
    try:
        serve.wait_ready(timeout_s=240)
        url = next(p for p in serve.ready_line.split() if p.startswith("gateway="))
        yield openai.OpenAI(base_url=url.removeprefix("gateway="), api_key="unused",
                            max_retries=0, timeout=120)
    finally:
        serve.terminate(grace_s=30)


@pytest.fixture(scope="module")
def chat_answer(client: openai.OpenAI) -> ChatCompletion:
    """What chat completions say, greedy, to the conversation the responses tests send."""
    return client.chat.completions.create(
        model=MODEL, max_tokens=MAX_TOKENS, temperature=0.0,
        messages=[{"role": "system", "content": INSTRUCTIONS},
                  {"role": "user", "content": QUESTION}])


def test_whole_response_says_what_chat_says(client: openai.OpenAI,
                                            chat_answer: ChatCompletion) -> None:
    response = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=MAX_TOKENS,
        temperature=0.0, metadata={"run": "e2e"}, store=True,
        extra_headers={"X-Request-Id": "responses-e2e-1"})
    choice = chat_answer.choices[0]
    assert choice.message.content and response.output_text == choice.message.content
    assert response.id == "resp_responses-e2e-1" and response.object == "response"
    assert response.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert response.metadata == {"run": "e2e"} and response.model == MODEL
    assert response.usage is not None and chat_answer.usage is not None
    assert response.usage.input_tokens == chat_answer.usage.prompt_tokens
    assert response.usage.output_tokens == chat_answer.usage.completion_tokens
    assert response.usage.total_tokens == chat_answer.usage.total_tokens


def test_streamed_response_says_what_chat_says(
        client: openai.OpenAI, chat_answer: ChatCompletion) -> None:
    events = list(client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS,
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=MAX_TOKENS, temperature=0.0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == chat_answer.choices[0].message.content
    final = events[-1].response
    assert final.output_text == text and final.usage is not None
    assert final.usage.output_tokens == chat_answer.usage.completion_tokens  # type: ignore[union-attr]


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Give me a person as JSON with name and age.",
        max_output_tokens=64, temperature=0.0,
        text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA,
                         "strict": True}})
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


def test_previous_response_id_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_x")
    assert "previous_response_id" in str(caught.value)


def test_named_function_call_then_its_output(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input=ASK, tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40, temperature=0.0)
    assert first.status == "completed"
    (call,) = first.output  # the call, and no message
    assert call.type == "function_call" and call.status == "completed"
    assert call.id.startswith("fc_") and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    assert first.tool_choice.type == "function"  # type: ignore[union-attr]
    # The conversation goes on: the call and its output sent back as input items.
    follow = client.responses.create(
        model=MODEL, tools=TOOLS, tool_choice="none", max_output_tokens=MAX_TOKENS,
        temperature=0.0, input=[
            *ASK, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id,
             "output": "sunny, 22 C"}])
    assert [item.type for item in follow.output] == ["message"]
    assert follow.output_text and follow.usage is not None
    assert follow.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]


def test_required_function_call_streamed(client: openai.OpenAI) -> None:
    events = list(client.responses.create(
        model=MODEL, input=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=40, temperature=0.0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = events[2].item  # type: ignore[union-attr]
    assert added.type == "function_call" and added.arguments == ""
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    assert events[-3].arguments == arguments  # type: ignore[union-attr]
    (call,) = events[-1].response.output  # type: ignore[union-attr]
    assert call.type == "function_call" and call.id == added.id
    assert call.call_id == added.call_id and call.arguments == arguments
    jsonschema.validate(json.loads(arguments), PARAMS[call.name])


def test_output_logprobs_are_chats_tokens(client: openai.OpenAI) -> None:
    """One entry per output token with `top_logprobs` alternatives each, spelling the output
    text, the same tokens and logprobs chat's `logprobs.content` gives; streamed, the deltas
    carry them in order."""
    tokens = 5  # the length limit ends it: every token has text
    asked: dict[str, Any] = {"model": MODEL, "instructions": INSTRUCTIONS, "input": QUESTION,
                             "max_output_tokens": tokens, "temperature": 0,
                             "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    response = client.responses.create(**asked)
    (message,) = response.output
    assert message.type == "message"
    (part,) = message.content
    assert part.type == "output_text" and part.logprobs is not None
    assert response.usage is not None and len(part.logprobs) == response.usage.output_tokens
    assert len(part.logprobs) == tokens and response.top_logprobs == 2
    assert all(len(lp.top_logprobs) == 2 and lp.bytes == list(lp.token.encode())
               for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs) == response.output_text
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=tokens, temperature=0, logprobs=True, top_logprobs=2,
        messages=[{"role": "system", "content": INSTRUCTIONS},
                  {"role": "user", "content": QUESTION}])
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None
    assert [t.token for t in content] == [lp.token for lp in part.logprobs]
    assert [lp.logprob for lp in part.logprobs] == pytest.approx(
        [t.logprob for t in content], abs=1e-3)
    events = list(client.responses.create(**asked, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    assert all(len(lp.top_logprobs or []) == 2 for lp in streamed)
    final = events[-1].response  # type: ignore[union-attr]
    final_logprobs = final.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert [lp.token for lp in final_logprobs] == [lp.token for lp in part.logprobs]
