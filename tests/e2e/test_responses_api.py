"""/v1/responses on a real mesh, driven by the official `openai` client's `responses.create`.

One colocated mesh (`pdmesh serve`, the cheapest shape: the Responses route differs from chat
only in the gateway, before and after the same router Generate call). A greedy response must
say exactly what /v1/chat/completions says for the same conversation, whole and streamed, and
`text.format` must constrain the output as chat's `response_format` does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion

from pdmesh.auth import TOKEN_ENV
from pdmesh.serve import Child, pdmesh_command

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


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    serve = Child("serve-responses", pdmesh_command(
        "serve", "--colocated", "--num-decode", "1", "--kv-cache-memory", KV_MEMORY,
        "--port", "0"), env=ENV)
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
