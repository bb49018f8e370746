"""/v1/completions' answers, whole and streamed: the legacy logprobs format (whose text
offsets run on across a choice's chunks), `echo` (the prompt's text before each choice's
output; with logprobs, the prompt's tokens and logprobs first, as vLLM answers it) and vLLM's
`prompt_logprobs` on each choice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from pdmesh.gateway.completion_schemas import CompletionChoice, CompletionResponse
from pdmesh.gateway.formatter import (
    Choice,
    Outputs,
    ResponseHead,
    StreamedDelta,
    sequence_failed,
)
from pdmesh.gateway.openai_format import (
    completion_choice,
    completion_logprobs,
    echo_logprobs,
    finish_reason,
    format_prompt_logprobs,
    stop_reason,
)
from pdmesh.v1 import common_pb2


@dataclass
class CompletionFormatter:
    """One completions request's answer (a `Formatter`)."""

    operation: ClassVar[str] = "completion"
    chunk_object: ClassVar[str] = "text_completion"

    n: int
    prompts: int
    want_logprobs: bool
    prompt_logprobs: int | None = None  # k of vLLM's `prompt_logprobs` (None: not asked)
    # `echo`: each prompt's text; with logprobs, each prompt's first token (the one the prompt
    # logprobs do not cover) and the alternatives kept per echoed prompt token.
    echo: list[str] | None = None
    echo_first_tokens: list[str] | None = None
    echo_k: int | None = None
    _offsets: dict[int, int] = field(default_factory=dict)  # streamed: per choice, its text

    def whole(self, head: ResponseHead, outputs: Outputs) -> CompletionResponse:
        states, prompt_logprobs = outputs.sequences, outputs.prompt_logprobs
        k = self.prompt_logprobs
        choices = [completion_choice(i, states[i], self.want_logprobs) for i in sorted(states)]
        for choice in choices:
            p = choice.index // self.n
            if k is not None:
                choice.prompt_logprobs = format_prompt_logprobs(prompt_logprobs.get(p, []), k)
            if self.echo is None:
                continue
            if self.echo_first_tokens is not None:
                choice.logprobs = echo_logprobs(
                    self.echo_first_tokens[p], prompt_logprobs.get(p, []),
                    states[choice.index].logprobs, len(self.echo[p]), self.echo_k)
            choice.text = self.echo[p] + choice.text
        return CompletionResponse(id=head.id, created=head.created, model=head.model,
                                  usage=outputs.usage, choices=choices)

    def opening(self) -> list[Choice]:
        """`echo` without logprobs: each prompt's text first, in a chunk per choice."""
        if self.echo is None or self.echo_first_tokens is not None:
            return []
        return [self._choice(i, self.echo[i // self.n]) for i in range(self.prompts * self.n)]

    def prompt_started(
        self, p: int, prompt_logprobs: list[common_pb2.TokenLogprob] | None
    ) -> list[Choice]:
        """`echo` with logprobs: prompt `p`'s text as the first chunk of each of its choices,
        with the prompt tokens' logprobs (as vLLM streams them; without them, from an
        instance that does not send them, the echo goes without logprobs)."""
        if self.echo is None or self.echo_first_tokens is None:
            return []
        text = self.echo[p]
        out = []
        for index in range(p * self.n, (p + 1) * self.n):
            logprobs = None
            if prompt_logprobs is not None:
                logprobs = echo_logprobs(self.echo_first_tokens[p], prompt_logprobs, [],
                                         len(text))
            out.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                        finish_reason=None).model_dump(mode="json"))
            self._offsets[index] = len(text)  # where the choice's output text starts
        return out

    def delta(self, index: int, delta: common_pb2.SequenceDelta) -> StreamedDelta:
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + sum(len(lp.text) for lp in delta.logprobs)
        return StreamedDelta([self._choice(index, delta.text, delta, offset)],
                             failed=sequence_failed(delta))

    def _choice(self, index: int, text: str, delta: common_pb2.SequenceDelta | None = None,
                offset: int = 0) -> Choice:
        finish = delta.finish if delta is not None and delta.HasField("finish") else None
        logprobs = list(delta.logprobs) if delta is not None and self.want_logprobs else None
        return CompletionChoice(
            index=index, text=text or "",
            logprobs=completion_logprobs(logprobs, offset) if logprobs is not None else None,
            finish_reason=finish_reason(finish), stop_reason=stop_reason(finish),
        ).model_dump(mode="json")
