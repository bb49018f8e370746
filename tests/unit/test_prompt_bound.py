"""The prompt-length bound (router/prompt_bound.py) and the router's prompt tokenizer pool.

The bound may only ever refuse prompts that really are too long, so it is checked against the
real SmolLM2 tokenizer on adversarial texts (long repeated tokens, bytes the vocabulary lacks,
special-token strings, characters that normalize to fewer bytes) and against small tokenizers
built here with the `tokenizers` library for the cases SmolLM2 does not cover.
"""

from __future__ import annotations

import asyncio
import random
import time
import unicodedata
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from pdmesh.metrics import router_metrics
from pdmesh.router.admission import InvalidRequest
from pdmesh.router.config import RouterConfig
from pdmesh.router.prompt_bound import _SHRINK, NoBound, PromptBound
from pdmesh.router.prompt_tokenizer import PromptTokenizer
from pdmesh.v1 import router_pb2

MAX_MODEL_LEN = 8192


def adversarial_texts(tokenizer: Any) -> list[str]:
    """Texts built to pack as many bytes as possible into few tokens, and ordinary ones."""
    rng = random.Random(0)
    vocab = tokenizer.backend_tokenizer.get_vocab()
    longest = sorted(vocab, key=len)[-20:]
    decoded = [tokenizer.convert_tokens_to_string([t]) for t in longest]
    return [
        *(d * 50 for d in decoded),
        "#" * 20_000, "=" * 20_000, "\n" + " " * 20_000, " " * 20_000,
        "<|im_start|>" * 2_000, "<|endoftext|>" * 2_000,
        "\x04" * 5_000 + "a", "\x04\x06\x13\x14\x16\x1d" * 1_000,  # bytes it has no token for
        "\U00050000" * 3_000 + "\U00090000" * 3_000,  # lead bytes 0xF1/0xF2 it lacks
        "\u212a" * 3_000,  # KELVIN SIGN
        "".join(rng.choices("abcdefghij klmnop\n\t.,", k=30_000)),
        bytes(rng.randrange(256) for _ in range(30_000)).decode("utf-8", "replace"),
        "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(10_000)),
        "".join(chr(rng.randint(0x1F300, 0x1F5FF)) for _ in range(10_000)),
        "e\u0301" * 10_000,
    ]


@pytest.fixture(scope="module")
def smollm2_bound(hf_tokenizer: Any) -> PromptBound:
    return PromptBound.of(hf_tokenizer.backend_tokenizer)


@pytest.mark.weights
def test_smollm2_bound_holds_on_adversarial_texts(
    hf_tokenizer: Any, smollm2_bound: PromptBound
) -> None:
    bound = smollm2_bound
    assert bound.shrink == 1 and "\x04" in bound.dropped
    for text in adversarial_texts(hf_tokenizer):
        n = len(hf_tokenizer(text, add_special_tokens=True)["input_ids"])
        counted = bound.counted_bytes(text)
        assert n >= bound.min_tokens(counted), (text[:40], n, counted)
        assert counted <= len(text.encode())


@pytest.mark.weights
def test_smollm2_bound_is_useful(hf_tokenizer: Any, smollm2_bound: PromptBound) -> None:
    """Not vacuous: a long token repeated comes within a small factor of the bound."""
    vocab = hf_tokenizer.backend_tokenizer.get_vocab()
    token = max((t for t in vocab if set(t) == {"#"}), key=len)  # a run of '#'
    text = hf_tokenizer.convert_tokens_to_string([token]) * 1000
    n = len(hf_tokenizer(text, add_special_tokens=False)["input_ids"])
    assert n <= 2 * smollm2_bound.min_tokens(len(text.encode()))
    assert smollm2_bound.max_bytes(MAX_MODEL_LEN) < 2 * 2**20  # a 2 MiB prompt is refused


@pytest.mark.weights
def test_check_refuses_only_provably_too_long_texts(smollm2_bound: PromptBound) -> None:
    bound = smollm2_bound
    limit = bound.max_bytes(MAX_MODEL_LEN)
    bound.check("a" * limit, MAX_MODEL_LEN)  # could still be < max_model_len tokens
    with pytest.raises(InvalidRequest) as info:
        bound.check("a" * (limit + 1), MAX_MODEL_LEN)
    assert info.value.field == "prompt"
    assert f"max_model_len={MAX_MODEL_LEN}" in str(info.value)
    # The bytes the tokenizer drops do not count towards the limit.
    bound.check("a" * limit + "\x04" * 1000, MAX_MODEL_LEN)
    # Multi-byte characters count their bytes: 3 per CJK character.
    bound.check("\u4e00" * (limit // 3), MAX_MODEL_LEN)
    with pytest.raises(InvalidRequest):
        bound.check("\u4e00" * (limit // 3 + 1), MAX_MODEL_LEN)
    with pytest.raises(InvalidRequest, match="messages"):
        bound.check("b" * (limit + 1), MAX_MODEL_LEN, field="messages")


@pytest.mark.weights
def test_check_of_a_huge_text_is_fast(smollm2_bound: PromptBound) -> None:
    text = "word " * (3 * 2**20)  # 15 MiB
    started = time.monotonic()
    with pytest.raises(InvalidRequest):
        smollm2_bound.check(text, MAX_MODEL_LEN)
    assert time.monotonic() - started < 1.0


# -- tokenizers the bound must cover, or refuse to bound -----------------------------------
def _byte_level_bpe(normalizer: Any = None, lstrip_token: bool = False) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|special|>"],
    )
    corpus = ["the quick brown fox jumps over the lazy dog " * 20, "=" * 200, "kelvin " * 50]
    tokenizer.train_from_iterator(corpus, trainer)
    if lstrip_token:
        from tokenizers import AddedToken

        tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    return tokenizer


@pytest.mark.fast
@pytest.mark.parametrize("normalizer,shrink", [
    (None, 1),
    (normalizers.NFC(), 3),
    (normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]), 12),
])
def test_trained_byte_level_bpe_bound_holds(normalizer: Any, shrink: int) -> None:
    tokenizer = _byte_level_bpe(normalizer)
    bound = PromptBound.of(tokenizer)
    assert bound.shrink == shrink
    texts = ["=" * 5000, "the quick brown fox " * 500, "\u212a" * 3000, "\U0001d400" * 3000,
             "\u1100\u1161\u11a8" * 2000, "<|special|>" * 1000, "\uff21" * 3000]
    for text in texts:
        n = len(tokenizer.encode(text).ids)
        assert n >= bound.min_tokens(bound.counted_bytes(text)), (text[:10], n)


@pytest.mark.fast
def test_unbounded_tokenizers_have_no_bound() -> None:
    with pytest.raises(NoBound, match="StripAccents"):
        PromptBound.of(_byte_level_bpe(normalizers.StripAccents()))
    with pytest.raises(NoBound, match="swallows whitespace"):
        PromptBound.of(_byte_level_bpe(lstrip_token=True))
    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(NoBound, match="WordLevel"):
        PromptBound.of(word_level)
    spec = {"model": {"type": "BPE", "vocab": {"a": 0}, "byte_fallback": False},
            "pre_tokenizer": {"type": "Metaspace"}}
    with pytest.raises(NoBound, match="byte-fallback"):
        PromptBound.from_json(spec)
    dropping = {"model": {"type": "BPE", "vocab": {}},
                "pre_tokenizer": {"type": "Split", "behavior": "Removed"}}
    with pytest.raises(NoBound, match="Split"):
        PromptBound.from_json(dropping)


@pytest.mark.fast
def test_sentencepiece_style_byte_fallback_is_bounded() -> None:
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({"\u2581hello": 256, "\u2581world": 257})
    spec = {
        "model": {"type": "BPE", "vocab": vocab, "byte_fallback": True, "unk_token": "<unk>"},
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        ]},
        "pre_tokenizer": None,
        "added_tokens": [{"content": "<s>", "lstrip": False, "rstrip": False}],
    }
    bound = PromptBound.from_json(spec)
    assert bound.shrink == 1  # " " -> "▁" grows the text
    assert bound.max_token_bytes == len("\u2581hello".encode())


@pytest.mark.slow
def test_normalizer_shrink_factors_cover_every_code_point() -> None:
    """No single character shrinks more than the table says (Python's Unicode tables)."""
    worst = {form: 1.0 for form in ("NFC", "NFD", "NFKC", "NFKD", "Lowercase")}
    for cp in range(0x110000):
        if 0xD800 <= cp < 0xE000:
            continue
        ch = chr(cp)
        size = len(ch.encode())
        for form in ("NFC", "NFD", "NFKC", "NFKD"):
            if not unicodedata.is_normalized(form, ch):
                out = unicodedata.normalize(form, ch)
                worst[form] = max(worst[form], size / max(1, len(out.encode())))
        lower = ch.lower()
        if lower != ch:
            worst["Lowercase"] = max(worst["Lowercase"], size / len(lower.encode()))
    for form, ratio in worst.items():
        assert ratio <= _SHRINK[form], (form, ratio)
    hangul = "\u1100\u1161\u11a8"  # L + V + T jamo compose into one syllable
    assert len(hangul.encode()) / len(unicodedata.normalize("NFC", hangul).encode()) <= 3


@pytest.mark.fast
def test_tokenizer_pool_size_is_validated() -> None:
    base = {"prefill": ("127.0.0.1:1",), "decode": ("127.0.0.1:2",)}
    assert RouterConfig(**base).tokenizer_pool_size == 2
    with pytest.raises(ValueError, match="--tokenizer-pool-size"):
        RouterConfig(**base, tokenizer_pool_size=0)


# -- the pool -------------------------------------------------------------------------------
def _text(text: str) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(text=text)


@pytest.mark.weights
def test_pool_refuses_provably_long_prompts_and_serves_small_ones_beside_big() -> None:
    registry = CollectorRegistry()
    tokenizer = PromptTokenizer("smollm2", pool_size=2,
                                wait=router_metrics(registry).tokenize_wait)
    rng = random.Random(1)
    big = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz ,.\n", k=400_000))
    assert tokenizer.bound is not None

    async def scenario() -> tuple[float, float, list[float]]:
        started = time.monotonic()
        await tokenizer.encode(_text(big))
        alone = time.monotonic() - started
        done: list[float] = []

        async def timed(text: str) -> None:
            await tokenizer.encode(_text(text))
            done.append(time.monotonic())

        bigs = [asyncio.ensure_future(timed(big)) for _ in range(2)]
        await asyncio.sleep(0)  # let both reach the pool first
        started = time.monotonic()
        ids = await tokenizer.encode(_text("Hello there"), MAX_MODEL_LEN)
        small = time.monotonic()
        assert ids
        await asyncio.gather(*bigs)
        return alone, small - started, [d - started for d in done]

    try:
        alone, small_s, bigs_s = asyncio.run(scenario())
        assert small_s < alone / 2 and small_s < min(bigs_s), (small_s, alone, bigs_s)

        def waited(lane: str, what: str) -> float:
            value = registry.get_sample_value(
                f"pdmesh:router_tokenize_wait_seconds_{what}", {"lane": lane})
            return value or 0.0

        # Three bigs (the first alone), one small; the second big waited for the first's lane.
        assert waited("large", "count") == 3 and waited("short", "count") == 1
        assert waited("short", "sum") < alone / 2 < waited("large", "sum"), (
            waited("short", "sum"), waited("large", "sum"), alone)

        huge = _text("word " * 2**20)
        started = time.monotonic()
        with pytest.raises(InvalidRequest, match=f"max_model_len={MAX_MODEL_LEN}"):
            asyncio.run(tokenizer.encode(huge, MAX_MODEL_LEN))
        assert time.monotonic() - started < alone
        chat = router_pb2.GenerateRequest(chat=router_pb2.Chat(
            messages=[router_pb2.ChatMessage(role="user", content="word " * 2**20)]))
        with pytest.raises(InvalidRequest, match="messages"):
            asyncio.run(tokenizer.encode(chat, MAX_MODEL_LEN))
        assert asyncio.run(tokenizer.encode(huge)) != []  # without a limit it tokenizes
    finally:
        tokenizer.close()
