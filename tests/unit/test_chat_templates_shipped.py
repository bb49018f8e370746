"""The tool-calling chat templates shipped with pdmesh (`--chat-template hermes|llama3_json`):
found by name, rendering tools and tool history, and asking for calls in the format their
`--tool-call-parser` of the same name reads back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdmesh.chat_templates import CHAT_TEMPLATES, named_chat_template
from pdmesh.gateway.tool_parsers import TOOL_PARSERS, collect
from pdmesh.router.prompt_tokenizer import load_chat_template

pytestmark = pytest.mark.fast

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = {"role": "user", "content": "Weather in Paris?"}
ASSISTANT_HEADER = {"hermes": "<|im_start|>assistant",
                    "llama3_json": "<|start_header_id|>assistant<|end_header_id|>"}


def render(name: str, messages: list[dict[str, Any]], tools: list[Any] | None = None,
           add_generation_prompt: bool = True) -> str:
    """The template rendered as transformers renders it (sandboxed Jinja, `tojson`)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent)  # transformers' own, no HTML escaping
    template = env.from_string(load_chat_template(name) or "")
    return template.render(messages=messages, tools=tools, bos_token="<s>",
                           add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATES))
def test_every_template_is_shipped_and_pairs_with_a_parser(name: str) -> None:
    assert load_chat_template(name) == named_chat_template(name)
    assert "{%" in (named_chat_template(name) or "")
    assert name in TOOL_PARSERS


def test_a_file_or_a_template_still_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    (tmp_path / "hermes").write_text("mine")
    monkeypatch.chdir(tmp_path)
    assert load_chat_template("hermes") == "mine"
    assert load_chat_template(None) is None and load_chat_template("  ") is None


def test_an_unknown_name_lists_the_shipped_ones() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json") as info:
        load_chat_template("hremes")
    assert "'hremes'" in str(info.value)


@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATES))
def test_tools_reach_the_prompt(name: str) -> None:
    with_tools = render(name, [ASK], [TOOL])
    assert "get_weather" in with_tools and "Weather in Paris?" in with_tools
    assert "get_weather" not in render(name, [ASK])


@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATES))
@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', {"city": "Paris"}])
def test_a_rendered_call_reads_back_through_its_parser(name: str, arguments: Any) -> None:
    """An assistant's call in the history is rendered as the model is asked to write one (so
    the parser of the same name reads it), whether its arguments came as JSON text (OpenAI's
    wire form) or as an object."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}
    history = [ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    before = render(name, [ASK], [TOOL])
    text = render(name, history, [TOOL], add_generation_prompt=False)
    assert text.startswith(before) and "sunny" in text
    turn = text[len(before):].split("sunny")[0]
    body = turn.split("<|im_start|>user")[0].split("<|eot_id|>")[0].removesuffix("<|im_end|>\n")
    body = body.removeprefix(ASSISTANT_HEADER[name]).strip()
    content, calls = collect(TOOL_PARSERS[name]().stream(), [body])
    assert content is None, body
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})], body
