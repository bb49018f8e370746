"""vLLM's `return_tokens_as_token_ids`: logprobs name each token `token_id:<id>` instead of
its text, so tokens that are not valid UTF-8 on their own (a byte of a multi-byte character)
stay identifiable.

A wrapper around any formatter (gateway/formatter.py), applied by the translation
(gateway/translate.py) when a request asks: it rewrites the router's logprob entries before the
formatter reads them, so every API kind, whole or streamed, answers alike (the completions
`text_offset`s then count the placeholders, as vLLM's do).
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel

from pdmesh.gateway.formatter import Choice, Formatter, Outputs, ResponseHead, StreamedDelta
from pdmesh.v1 import common_pb2


def token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def name_by_id(entries: Iterable[common_pb2.TokenLogprob]) -> None:
    """In place: each entry's token and candidates named by their ids."""
    for entry in entries:
        entry.text = token_id_text(entry.token_id)
        for candidate in entry.top:
            candidate.text = token_id_text(candidate.token_id)


class TokenIdLogprobs:
    """`inner`, with logprob tokens named by id."""

    def __init__(self, inner: Formatter) -> None:
        self.inner = inner
        self.operation = inner.operation
        self.chunk_object = inner.chunk_object

    def whole(self, head: ResponseHead, outputs: Outputs) -> BaseModel:
        for seq in outputs.sequences.values():
            name_by_id(seq.logprobs)
        for entries in outputs.prompt_logprobs.values():
            name_by_id(entries)
        return self.inner.whole(head, outputs)

    def opening(self) -> list[Choice]:
        return self.inner.opening()

    def prompt_started(
        self, p: int, prompt_logprobs: list[common_pb2.TokenLogprob] | None
    ) -> list[Choice]:
        if prompt_logprobs:
            name_by_id(prompt_logprobs)
        return self.inner.prompt_started(p, prompt_logprobs)

    def delta(self, index: int, delta: common_pb2.SequenceDelta) -> StreamedDelta:
        if delta.logprobs:
            renamed = common_pb2.SequenceDelta()
            renamed.CopyFrom(delta)  # the caller's delta also feeds the whole answer's state
            name_by_id(renamed.logprobs)
            delta = renamed
        return self.inner.delta(index, delta)
