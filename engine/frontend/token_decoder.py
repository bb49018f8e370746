"""Output tokens to final text, one token at a time: the decoding half of detokenization.

Decoding only the newest token is wrong in two ways: a byte-level BPE token can hold part of a
multi-byte UTF-8 character (decoding it alone yields U+FFFD), and SentencePiece-style decoders
treat the first token of a decode specially (they strip its leading space). So each step decodes
a small *window*: a few already-committed tokens for context plus the new ones, and commits the
characters past what the window had already produced. Text that ends in U+FFFD is held back
until the character completes. Per step this costs O(window), not O(output). A window only
starts where a step decoded cleanly (and the prompt context on a whole character): a
byte-fallback tokenizer (Llama 2, Mistral) decodes a run of byte pieces as a unit, so a window
starting inside a character would turn the whole run into U+FFFD.

Two decoders do this, with the same results:

- `StreamDecoder`, for tokenizers backed by the Rust `tokenizers` library (every Hugging Face
  "fast" tokenizer): its `DecodeStream` runs the window in Rust; a token costs the output
  processor 2-5x less than with the Python window (bench/README.md, "Detokenization per
  token"). On a GPU a serving process detokenizes every token of every request, ~13k a second
  at batch 128, so this is the difference between a few percent of a core and a third of one.
- `WindowDecoder`, the same window in Python over any `decode(ids)`: slow tokenizers, and the
  fallback a `StreamDecoder` switches to when `DecodeStream` refuses (its prefix check) or holds
  text back too long.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 4
"""Committed tokens kept at the head of the decode window (and taken from the prompt tail)."""
MAX_WINDOW_TOKENS = 24
"""A window still ending in U+FFFD after this many tokens holds genuinely invalid bytes (or a
literal U+FFFD); it is committed as is so the window cannot grow without bound."""


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the decoders use."""

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = ...,
        clean_up_tokenization_spaces: bool | None = ...,
    ) -> str: ...


class TokenDecoder(Protocol):
    """Turns one sequence's output tokens into text as they come."""

    def step(self, token_id: int) -> str:
        """Append one token; return the characters that became final with it."""
        ...

    def pending(self) -> str:
        """Text decoded but not final yet (an incomplete character at the end)."""
        ...


def decode_tokens(tokenizer: Tokenizer, token_ids: Sequence[int], skip_special: bool) -> str:
    # No clean-up: it rewrites text across token boundaries, so windows would disagree with
    # each other and with a full decode.
    return tokenizer.decode(
        list(token_ids), skip_special_tokens=skip_special, clean_up_tokenization_spaces=False
    )


def window_start(boundaries: Sequence[int], length: int) -> int:
    """Where a window of `length` tokens may start now: the last boundary (a position where a
    step decoded cleanly) that keeps CONTEXT_TOKENS tokens before the end, so each step
    decodes O(CONTEXT_TOKENS) tokens, not O(output); 0 while there is none."""
    last = length - CONTEXT_TOKENS
    return max((b for b in boundaries if b <= last), default=0)


class WindowDecoder:
    """The decode window in Python, over any tokenizer's `decode`.

    Each step decodes the window (a few emitted tokens for context, then the new ones) and
    commits the characters past those already emitted, except a trailing run of U+FFFD: an
    incomplete character, which later bytes complete. The window only ever starts where a step
    decoded cleanly (a *boundary*): with byte-fallback tokenizers (Llama 2, Mistral) a run of
    byte tokens decodes as a unit, and one that started mid-character would turn whole into
    U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int],
                 skip_special: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids: list[int] = list(context_ids)
        self._committed = len(self._decode(self._ids))  # characters of the window emitted
        self._boundaries = [0]  # window positions after a clean step; the window starts at one
        self._pending = ""

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        stable = len(text)
        if text.endswith(REPLACEMENT_CHAR) and len(self._ids) <= MAX_WINDOW_TOKENS:
            stable = len(text.rstrip(REPLACEMENT_CHAR))
        committed = max(self._committed, stable)
        new_text = text[self._committed : committed]
        self._committed = committed
        self._pending = text[committed:]
        if not self._pending:
            self._boundaries.append(len(self._ids))
            self._slide()
        return new_text

    def pending(self) -> str:
        return self._pending

    def _slide(self) -> None:
        start = window_start(self._boundaries, len(self._ids))
        if start == 0:
            return
        del self._ids[:start]
        self._boundaries = [b - start for b in self._boundaries if b >= start]
        # Everything in the shorter window was emitted already; measure it once to rebase.
        self._committed = len(self._decode(self._ids))

    def _decode(self, token_ids: Sequence[int]) -> str:
        return decode_tokens(self._tokenizer, token_ids, self._skip_special)


class StreamDecoder:
    """The decode window in Rust: `tokenizers.decoders.DecodeStream` over the fast tokenizer.

    `DecodeStream.step` returns None while the newest text ends in U+FFFD (or adds nothing,
    as a skipped special token does); those tokens are *held* here, so that `pending` can
    decode them on demand and so a `WindowDecoder` can take over where the stream left off:
    when `DecodeStream` raises (the window's text no longer starts with what it already gave
    out, which some normalizing decoders do) or has held MAX_WINDOW_TOKENS tokens (invalid
    bytes, which the Python window commits as U+FFFD at that point, as a full decode does).
    """

    def __init__(self, tokenizer: Tokenizer, backend: Any, context_ids: Sequence[int],
                 skip_special: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._backend = backend
        self._skip_special = skip_special
        self._stream = DecodeStream(skip_special_tokens=skip_special)
        # The emitted tokens before the held ones, from a boundary on (as in WindowDecoder):
        # what `pending` and a fallback decode after.
        self._context: list[int] = list(context_ids)
        self._boundaries = [0, len(self._context)]
        self._held: list[int] = []
        self._fallback: WindowDecoder | None = None
        self._pending: str | None = None  # pending(), computed on demand
        for token_id in self._context:  # prime it: the context counts as already emitted
            self._stream.step(backend, token_id)

    def step(self, token_id: int) -> str:
        if self._fallback is not None:
            return self._fallback.step(token_id)
        self._pending = None
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception as exc:  # tokenizers raises a plain Exception (its prefix check)
            logger.debug("DecodeStream refused a token (%s); decoding in Python", exc)
            return self._fall_back(token_id)
        if text is None:
            self._held.append(token_id)
            if len(self._held) > MAX_WINDOW_TOKENS:
                return self._fall_back(None)
            return ""
        self._context += [*self._held, token_id]
        self._boundaries.append(len(self._context))
        self._held = []
        start = window_start(self._boundaries, len(self._context))
        if start:
            del self._context[:start]
            self._boundaries = [b - start for b in self._boundaries if b >= start]
        return text

    def pending(self) -> str:
        if self._fallback is not None:
            return self._fallback.pending()
        if not self._held:
            return ""
        if self._pending is None:  # decoded once per step, in Rust (no clean-up there either)
            decode = self._backend.decode
            head = decode(self._context, skip_special_tokens=self._skip_special)
            text = decode([*self._context, *self._held], skip_special_tokens=self._skip_special)
            self._pending = text[len(head):]
        return self._pending

    def _fall_back(self, token_id: int | None) -> str:
        """Continue in a `WindowDecoder` from the last token the stream gave text for."""
        self._fallback = WindowDecoder(self._tokenizer, self._context, self._skip_special)
        held = [*self._held, *([] if token_id is None else [token_id])]
        self._held = []
        return "".join(self._fallback.step(t) for t in held)


def prompt_context(tokenizer: Tokenizer, prompt_ids: Sequence[int],
                   skip_special: bool) -> list[int]:
    """The prompt tail a decoder starts from: its last CONTEXT_TOKENS tokens, reaching further
    back (up to MAX_WINDOW_TOKENS) while they begin inside a character, since a window that
    starts mid-character can decode wrong as a whole (byte-fallback runs)."""
    for length in range(CONTEXT_TOKENS, MAX_WINDOW_TOKENS + 1):
        if length > len(prompt_ids):
            return list(prompt_ids)
        context = list(prompt_ids[-length:])
        if not decode_tokens(tokenizer, context, skip_special).startswith(REPLACEMENT_CHAR):
            return context
    return list(prompt_ids[-CONTEXT_TOKENS:])


def rust_tokenizer(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind a Hugging Face fast tokenizer, or None."""
    try:
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21)
    except ImportError:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, RustTokenizer) else None


def make_token_decoder(tokenizer: Tokenizer, prompt_ids: Sequence[int],
                       skip_special: bool) -> TokenDecoder:
    """A decoder for a sequence after `prompt_ids`: a `StreamDecoder` where the tokenizer is a
    fast one, else a `WindowDecoder`."""
    context = prompt_context(tokenizer, prompt_ids, skip_special)
    backend = rust_tokenizer(tokenizer)
    if backend is None:
        return WindowDecoder(tokenizer, context, skip_special)
    return StreamDecoder(tokenizer, backend, context, skip_special)
