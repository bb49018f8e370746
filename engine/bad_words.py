"""vLLM's `bad_words`: words whose token sequences a sample must never produce.

Two halves, both torch-free so the router (which tokenizes, and imports no torch) shares them:

* `tokenize_bad_words`: each word to token sequences where the tokenizer is (the router), as
  vLLM does: the word without and with a leading space (a word at the start of the text and
  in its middle tokenize differently), the spaced form kept only when it is a different
  sequence of the same length. At most `MAX_BAD_WORDS` sequences.
* `banned_next_tokens`: what one sample may not pick next (the engine core masks those
  logits, engine/worker/step_sampling.py): a one-token word always; a longer word's last token when
  the sample's output ends with the rest of it. Only output tokens count, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MAX_BAD_WORDS = 128
"""Token sequences per request after tokenization (vLLM's VLLM_MAX_NUM_BAD_WORDS default)."""


def tokenize_bad_words(encode: Callable[[str], list[int]],
                       words: Sequence[str]) -> list[list[int]]:
    """The sequences to ban for `words`; `encode(text)` tokenizes without special tokens.
    ValueError (starting with the field's name) for a word that tokenizes to nothing or too
    many sequences."""
    sequences: list[list[int]] = []
    for word in dict.fromkeys(words):  # duplicates once, in order
        bare = encode(word.lstrip())
        if not bare:
            raise ValueError(f"bad_words entries must tokenize to at least one token, got "
                             f"{word!r}")
        sequences.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
        if len(sequences) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words: too many after tokenization ({len(sequences)} token "
                             f"sequences); the most is {MAX_BAD_WORDS}")
    return sequences


def banned_next_tokens(sequences: Sequence[Sequence[int]], token_ids: Sequence[int],
                       num_prompt_tokens: int) -> list[int]:
    """The tokens a sample whose tokens are `token_ids` (prompt first) must not pick next."""
    num_output = len(token_ids) - num_prompt_tokens
    banned: list[int] = []
    for seq in sequences:
        prefix = len(seq) - 1
        if prefix == 0:
            banned.append(seq[0])
        elif prefix <= num_output and token_ids[-1] == seq[-2] and \
                list(token_ids[len(token_ids) - prefix:]) == list(seq[:-1]):
            banned.append(seq[-1])
    return banned
