"""A lower bound on a prompt's token count from its byte length alone, to refuse prompts that
cannot fit in `max_model_len` without spending seconds tokenizing them.

Why the bound holds. The bound we need is a *lower* one (at least so many tokens): "at most
one token per byte" is true but proves nothing about being too long. For a tokenizer that
loses no input (every byte of the text ends up inside exactly one token), the tokens tile the
text, so

    bytes(text) = sum over tokens of bytes(token) <= num_tokens * L

where L is the most text bytes one token can stand for. Hence num_tokens >= ceil(B / L) for a
prompt of B bytes, and a prompt with ceil(B / L) >= max_model_len can never be served
(`validate_prompt` needs at least one position left to generate), whatever its tokens are.

- L is computed once from the vocabulary: a byte-level BPE token (SmolLM2, Llama-3, Qwen2)
  is written in the byte alphabet (one character per byte), so it covers len(token) bytes; any
  other token (SentencePiece pieces, "<0x41>" byte-fallback tokens, added/special tokens such
  as "<|im_start|>", which match their literal text) covers at most its UTF-8 length.
- Normalizers can shrink text before it is split (NFC maps U+212A KELVIN SIGN, 3 bytes, to
  "K", 1 byte; NFKC maps a 4-byte mathematical letter to 1 byte), so a normalizer's worst
  bytes-in / bytes-out ratio S multiplies L: num_tokens >= ceil(B / (S * L)).
- A byte-level vocabulary may lack a few bytes' tokens; BPE then silently drops those bytes
  (SmolLM2 has no token for the control bytes 0x04, 0x06, 0x13, 0x14, 0x16, 0x1D: a prompt of
  1000 x "\x04" is zero tokens). Bytes that valid UTF-8 never contains (0xC0, 0xC1, 0xF5-0xFF)
  do not matter; missing ASCII bytes are `dropped` and not counted in B. Missing lead bytes
  of multi-byte characters (SmolLM2 lacks 0xF1 and 0xF2, used from U+40000 on) cost each such
  character at most that one byte: while all continuation bytes have tokens, every character
  keeps at least one covered byte, so a text holding such characters counts characters.
- Anything else that may drop text or let one token swallow unbounded text breaks the tiling:
  whitespace-removing pre-tokenizers, strip/strip-accents normalizers, an unknown token
  (WordPiece, Unigram, BPE without byte fallback), added tokens that strip the whitespace
  around them. For those, and for any component we do not know, there is no bound
  (`NoBound`) and prompts are simply tokenized.

Special tokens that the post-processor adds (BOS) only add to the count, so they are ignored.
A chat prompt is bounded by its rendered template text (what is tokenized), not by the sum of
its messages: a template may leave content out.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from pdmesh.router.admission import InvalidRequest

# Worst bytes-in / bytes-out ratio of one normalizer step over any input (tests/unit checks it
# for every code point). NFC/NFD: U+212A KELVIN SIGN (3 bytes) -> "K", and a Hangul L+V+T
# jamo triple (9 bytes) -> one syllable (3 bytes). NFKC/NFKD: U+1D400 (4 bytes) -> "A".
# Lowercase: U+212A -> "k". Prepend and ByteLevel (one character per byte) only add text.
_SHRINK = {"NFC": 3, "NFD": 3, "NFKC": 4, "NFKD": 4, "Lowercase": 3, "Prepend": 1,
           "ByteLevel": 1}
# Pre-tokenizers that split text without dropping any of it ("Removed" would drop).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation",
                           "UnicodeScripts"}


class NoBound(ValueError):
    """The tokenizer can turn many bytes into few tokens; says which part and why."""


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character standing for each byte, to that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    code_points = {b: b for b in printable}
    for b in range(256):
        if b not in code_points:
            code_points[b] = 256 + len(code_points) - len(printable)
    return {chr(c): b for b, c in code_points.items()}


@dataclass(frozen=True)
class PromptBound:
    """At least ceil(bytes / bytes_per_token) tokens for any text with `bytes` UTF-8 bytes
    (not counting the `dropped` characters)."""

    max_token_bytes: int  # L: the most text bytes one token stands for
    shrink: int = 1  # S: the normalizer shrinks text by at most this factor
    dropped: str = ""  # ASCII characters the tokenizer drops (no token has their byte)
    lossy_from: int | None = None  # from this code point on, a character may lose one byte

    @property
    def bytes_per_token(self) -> int:
        return self.max_token_bytes * self.shrink

    def min_tokens(self, num_bytes: int) -> int:
        return -(-num_bytes // self.bytes_per_token)

    def max_bytes(self, max_model_len: int) -> int:
        """The most counted bytes a text may have and still not be proven too long."""
        return (max_model_len - 1) * self.bytes_per_token

    def counted_bytes(self, text: str, enough: int | None = None) -> int:
        """A lower bound on the bytes of `text` that tokens must cover: its UTF-8 length less
        the dropped characters (or its character count, see the module docstring). Once the
        cheap character count exceeds `enough`, that is returned without encoding the text."""
        dropped = sum(text.count(ch) for ch in self.dropped)
        counted = len(text) - dropped  # every other character keeps at least one byte
        if text.isascii() or (enough is not None and counted > enough):
            return counted
        if self.lossy_from is not None and re.search(
            f"[{chr(self.lossy_from)}-\U0010FFFF]", text
        ):
            return counted
        return len(text.encode("utf-8", "surrogatepass")) - dropped

    def check(self, text: str, max_model_len: int, field: str = "prompt") -> None:
        """Raise InvalidRequest when `text` provably leaves no room to generate.

        Costs a few fast scans of the text; a text far over the bound is refused on its
        character count alone, without encoding it.
        """
        limit = self.max_bytes(max_model_len)
        counted = self.counted_bytes(text, enough=limit)
        if counted > limit:
            raise InvalidRequest(
                field,
                f"the text has at least {counted} bytes, so at least "
                f"{self.min_tokens(counted)} tokens (no token covers more than "
                f"{self.bytes_per_token} bytes), which leave no room to generate within "
                f"max_model_len={max_model_len}",
            )

    @classmethod
    def of(cls, tokenizer: Any) -> PromptBound:
        """The bound of a `tokenizers.Tokenizer` (an HF fast tokenizer's `backend_tokenizer`).

        Raises NoBound when the tokenizer can drop text or map unbounded text to one token.
        """
        return cls.from_json(json.loads(tokenizer.to_str()))

    @classmethod
    def from_json(cls, spec: dict[str, Any]) -> PromptBound:
        """The bound of a tokenizer given as its `tokenizer.json` document."""
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise NoBound(f"model {model.get('type')!r}: only BPE tokenizers are bounded")
        pre_tokenizers = _flatten(spec.get("pre_tokenizer"), "pretokenizers")
        for pre in pre_tokenizers:
            kind = pre.get("type")
            if kind not in _KEEPING_PRE_TOKENIZERS or pre.get("behavior") == "Removed":
                raise NoBound(f"pre_tokenizer {kind!r} may drop text")
        vocab: dict[str, int] = model.get("vocab") or {}
        alphabet = byte_alphabet()
        normalizers = _flatten(spec.get("normalizer"), "normalizers")
        byte_level = any(p.get("type") == "ByteLevel" for p in [*pre_tokenizers, *normalizers])
        dropped, lossy_from = "", None
        if byte_level:
            missing = sorted(b for ch, b in alphabet.items() if ch not in vocab)
            if any(0x80 <= b < 0xC0 for b in missing):
                raise NoBound("byte-level vocabulary lacks tokens for UTF-8 continuation bytes")
            dropped = "".join(chr(b) for b in missing if b < 0x80)
            leads = [_first_code_point(b) for b in missing if 0xC2 <= b < 0xF5]
            lossy_from = min(leads, default=None)
        elif not (model.get("byte_fallback")
                  and all(f"<0x{b:02X}>" in vocab for b in range(256))):
            raise NoBound("BPE without byte-level or byte-fallback tokens can drop text")
        longest = max((_token_bytes(token, alphabet if byte_level else None)
                       for token in vocab), default=1)
        for added in spec.get("added_tokens") or ():
            if added.get("lstrip") or added.get("rstrip"):
                raise NoBound(f"added token {added.get('content')!r} swallows whitespace")
            longest = max(longest, len(str(added.get("content", "")).encode()))
        return cls(max_token_bytes=max(1, longest), shrink=_shrink(spec.get("normalizer")),
                   dropped=dropped, lossy_from=lossy_from)


def _flatten(component: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [leaf for part in component.get(key, []) for leaf in _flatten(part, key)]
    return [component]


def _first_code_point(lead: int) -> int:
    """The smallest code point whose UTF-8 form starts with the byte `lead` (0xC2-0xF4)."""
    if lead < 0xE0:
        return (lead & 0x1F) << 6
    if lead < 0xF0:
        return max(0x800, (lead & 0x0F) << 12)
    return max(0x10000, (lead & 0x07) << 18)


def _token_bytes(token: str, alphabet: dict[str, int] | None) -> int:
    if alphabet is not None and all(ch in alphabet for ch in token):
        return len(token)  # one alphabet character per byte
    return len(token.encode())


def _shrink(normalizer: dict[str, Any] | None) -> int:
    factor = 1
    for step in _flatten(normalizer, "normalizers"):
        kind = step.get("type")
        if kind == "Replace":
            factor *= _replace_shrink(step)
        elif kind in _SHRINK:
            factor *= _SHRINK[kind]
        else:
            raise NoBound(f"normalizer {kind!r} may shrink text without bound")
    return factor


def _replace_shrink(step: dict[str, Any]) -> int:
    pattern = (step.get("pattern") or {}).get("String")
    content = str(step.get("content", ""))
    if pattern is None:
        raise NoBound("normalizer 'Replace' with a regex may shrink text without bound")
    if not content:
        raise NoBound(f"normalizer 'Replace' deletes {pattern!r}")
    return max(1, math.ceil(len(pattern.encode()) / len(content.encode())))
