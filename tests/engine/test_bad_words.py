"""`bad_words` on real weights: a greedy output that would contain a word does not once the
word is banned, for a one-token word (masked at every step) and a multi-token one (its last
token masked only where the output ends with the rest of it, so its prefix stays free)."""

from __future__ import annotations

from typing import Any

import pytest

from pdmesh import LLM, SamplingParams
from pdmesh.engine.bad_words import tokenize_bad_words

pytestmark = [pytest.mark.slow, pytest.mark.weights]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2", kv_cache_memory="64MiB", max_model_len=256)


def greedy(llm: LLM, prompt: str, banned: list[str] | None = None) -> Any:
    """The greedy completion, with `banned` tokenized as the router does."""
    tokenizer = llm.get_tokenizer()
    sequences = None if banned is None else tokenize_bad_words(
        lambda text: list(tokenizer.encode(text, add_special_tokens=False)), banned)
    params = SamplingParams(temperature=0, max_tokens=12, bad_words=banned,
                            bad_words_token_ids=sequences)
    return llm.generate(prompt, params)[0].outputs[0]


def test_a_banned_word_is_never_generated(llm: LLM) -> None:
    prompt = "The capital of France is"
    assert "Paris" in greedy(llm, prompt).text
    assert "Paris" not in greedy(llm, prompt, ["Paris"]).text


def test_a_banned_phrase_keeps_its_prefix_free(llm: LLM) -> None:
    prompt = "Count from one to ten: one, two, three,"
    assert "five, six" in greedy(llm, prompt).text
    text = greedy(llm, prompt, ["five, six"]).text
    assert "five, six" not in text and "five," in text  # only the completing token is banned
