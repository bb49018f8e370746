"""`apply_chat_template(..., tools=)`: the one function the router and the offline `LLM.chat`
use puts the tools into the prompt through the template."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pdmesh.chat_templates import named_chat_template
from pdmesh.engine.chat_template import apply_chat_template

pytestmark = pytest.mark.weights

TEMPLATE = named_chat_template("hermes") or ""
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(name="tokenizer", scope="module")
def tokenizer_fixture(model_dir: Path):  # type: ignore[no-untyped-def]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_tools_reach_the_template(tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = tokenizer.decode(apply_chat_template(tokenizer, messages, True, [TOOL]))
    without = tokenizer.decode(apply_chat_template(tokenizer, messages, True))
    assert "get_weather" in with_tools and "get_weather" not in without


def test_tool_history_renders_and_bad_roles_are_refused(tokenizer) -> None:  # type: ignore[no-untyped-def]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    text = tokenizer.decode(apply_chat_template(tokenizer, history, True, [TOOL]))
    assert "Paris" in text and "sunny" in text
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        apply_chat_template(tokenizer, [{"role": "wizard", "content": "x"}], True, [TOOL])


THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content or '' }}{% endfor %}")
"""Renders an assistant turn's thinking, as Qwen3's template does within a tool-calling turn."""


def test_an_assistant_s_reasoning_reaches_the_template(model_dir: Path) -> None:
    """An assistant message's `reasoning`, sent back by the client, is what the template reads
    as `reasoning_content`, through the router's conversion of the chat."""
    from pdmesh.router.prompt_tokenizer import chat_messages
    from pdmesh.v1 import router_pb2

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = THINKING_TEMPLATE
    chat = router_pb2.Chat(messages=[
        router_pb2.ChatMessage(role="user", content="hi"),
        router_pb2.ChatMessage(role="assistant", content="Hello!", reasoning="Greet back.")])
    rendered = tokenizer.decode(apply_chat_template(
        tokenizer, chat_messages(chat), add_generation_prompt=False))
    assert "<|user|>hi<|assistant|><think>Greet back.</think>Hello!" in rendered
