"""The router's half of vLLM's request fields, on the real tokenizer: chat_template_kwargs reach
the template it renders (over the server's --default-chat-template-kwargs),
truncate_prompt_tokens cuts what it tokenized (Generate and Tokenize alike, a prompt too long to
serve whole included), bad_words become the token sequences the engines ban."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from pdmesh.engine.chat_template import parse_template_defaults
from pdmesh.router.admission import InvalidRequest
from pdmesh.router.prompt_tokenizer import PromptTokenizer
from pdmesh.v1 import router_pb2

pytestmark = [pytest.mark.slow, pytest.mark.weights]

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if enable_thinking is false %}[no thinking]{% else %}[thinking]{% endif %}")


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer("smollm2", pool_size=1, chat_template=TEMPLATE)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def chat(**kwargs: Any) -> router_pb2.Chat:
    return router_pb2.Chat(messages=[router_pb2.ChatMessage(role="user", content="hi")],
                           chat_template_kwargs_json=json.dumps(kwargs) if kwargs else "")


def test_template_kwargs_reach_the_render(tokenizer: PromptTokenizer) -> None:
    def rendered(request: Any) -> str:
        return run(tokenizer.decode(run(tokenizer.encode(request, 1000))))[0]

    assert rendered(router_pb2.GenerateRequest(chat=chat())).endswith("<user>hi[thinking]")
    assert rendered(router_pb2.GenerateRequest(chat=chat(enable_thinking=False))).endswith(
        "<user>hi[no thinking]")
    tokenized = run(tokenizer.encode(router_pb2.TokenizeRequest(chat=chat(enable_thinking=False))))
    assert run(tokenizer.decode(tokenized))[0].endswith("[no thinking]")  # Tokenize as Generate
    with pytest.raises(InvalidRequest, match="chat_template_kwargs: add_generation_prompt"):
        run(tokenizer.encode(router_pb2.GenerateRequest(chat=chat(add_generation_prompt=True))))


def test_server_template_defaults_sit_under_the_request(tokenizer: PromptTokenizer) -> None:
    """`--default-chat-template-kwargs`: every render gets them; a request's own
    chat_template_kwargs win key by key."""
    served = PromptTokenizer("smollm2", pool_size=1, chat_template=TEMPLATE,
                             template_defaults=parse_template_defaults(
                                 '{"enable_thinking": false}'))

    def rendered(request: Any) -> str:
        return run(served.decode(run(served.encode(request, 1000))))[0]

    try:
        assert rendered(router_pb2.GenerateRequest(chat=chat())).endswith("[no thinking]")
        assert rendered(router_pb2.GenerateRequest(chat=chat(enable_thinking=True))).endswith(
            "<user>hi[thinking]")
        tokenized = run(served.encode(router_pb2.TokenizeRequest(chat=chat())))
        assert run(served.decode(tokenized))[0].endswith("[no thinking]")
    finally:
        served.close()
    with pytest.raises(ValueError, match="--default-chat-template-kwargs: messages cannot"):
        parse_template_defaults('{"messages": []}')
    with pytest.raises(ValueError, match="--default-chat-template-kwargs: not valid JSON"):
        parse_template_defaults("enable_thinking=false")


def test_truncation_keeps_the_last_tokens_of_what_was_tokenized(
        tokenizer: PromptTokenizer) -> None:
    text = "one two three four five six seven eight nine ten"
    whole = run(tokenizer.encode(router_pb2.GenerateRequest(text=text), 1000))
    kept = run(tokenizer.encode(router_pb2.GenerateRequest(text=text, truncate_prompt_tokens=4),
                                1000))
    assert kept == whole[-4:]
    tokenize = router_pb2.TokenizeRequest(text=text, truncate_prompt_tokens=-1)
    assert run(tokenizer.encode(tokenize, context_len=5)) == whole[-4:]  # max_model_len - 1
    # A prompt far too long to serve whole is tokenized and cut, not refused.
    long = router_pb2.GenerateRequest(text="word " * 4000, truncate_prompt_tokens=-1)
    assert len(run(tokenizer.encode(long, 64))) == 63
    with pytest.raises(InvalidRequest, match="truncate_prompt_tokens: 65 cannot be greater"):
        run(tokenizer.encode(router_pb2.GenerateRequest(text=text, truncate_prompt_tokens=65),
                             64))
    chat_ids = run(tokenizer.encode(router_pb2.GenerateRequest(
        chat=chat(), truncate_prompt_tokens=3), 1000))
    assert len(chat_ids) == 3


def test_bad_words_become_token_sequences(tokenizer: PromptTokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer.model_dir)
    sequences = run(tokenizer.bad_words_token_ids(["Paris", "five, six"]))
    assert sequences == [hf.encode("Paris", add_special_tokens=False),
                         hf.encode(" Paris", add_special_tokens=False),
                         hf.encode("five, six", add_special_tokens=False),
                         hf.encode(" five, six", add_special_tokens=False)]
    with pytest.raises(InvalidRequest, match=r"sampling\.bad_words: .*too many"):
        run(tokenizer.bad_words_token_ids([f"word{i}" for i in range(200)]))
