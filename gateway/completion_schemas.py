"""/v1/completions' bodies: the request (one prompt or several; `echo`; legacy logprobs) and
the response, whole and streamed."""

from __future__ import annotations

from typing import Annotated, Literal, cast

from pydantic import BaseModel, Field, field_validator

from pdmesh.engine_svc import codec
from pdmesh.gateway.schemas import PromptLogprobs, SamplingFields, UsageInfo, wire_int
from pdmesh.v1 import common_pb2, router_pb2

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's (and vLLM's) default for /v1/completions; chat defaults to the context limit."""


_SP = common_pb2.SamplingParams


def _one_k(*asked: int | None) -> int | None:
    """One prompt-logprobs k serving several answers: the largest (each answer keeps its own
    top k); a negative one (vLLM's -1, the whole vocabulary) goes as is, for the router to
    refuse."""
    ks = [k for k in asked if k is not None]
    if not ks:
        return None
    return min(ks) if min(ks) < 0 else max(ks)


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Annotated[int, wire_int(_SP, "max_tokens", ge=1)] | None = \
        COMPLETIONS_DEFAULT_MAX_TOKENS
    # Completions: the number of alternatives per token (0 = the sampled token only).
    logprobs: Annotated[int, wire_int(_SP, "logprobs", ge=0)] | None = None
    # The prompt's text before each choice's output.
    echo: bool = False
    # vLLM's: a text prompt gets the tokenizer's special tokens (BOS); false for prompts that
    # carry their own.
    add_special_tokens: bool = True
    # OpenAI's fill-in-the-middle text. Refused, as vLLM refuses it: a client that offers FIM
    # learns from the 400 to fall back, where ignoring it would answer a plain continuation.
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix is not None:
            raise ValueError("suffix is not currently supported")
        return suffix

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, prompt: Prompt) -> Prompt:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be an empty list")
        if isinstance(prompt, list) and any(isinstance(p, list) and not p for p in prompt):
            raise ValueError("prompt must not contain an empty token list")
        if isinstance(prompt, str) or isinstance(prompt[0], str):
            return prompt
        nested = isinstance(prompt[0], list)
        token_lists = cast(list[list[int]], prompt if nested else [prompt])
        low, high = codec.int_range(router_pb2.GenerateRequest, "token_ids.ids")
        for i, ids in enumerate(token_lists):
            if low <= min(ids) and max(ids) <= high:
                continue
            j, bad = next((j, t) for j, t in enumerate(ids) if not low <= t <= high)
            where = f"prompt[{i}][{j}]" if nested else f"prompt[{j}]"
            codec.check_int(router_pb2.GenerateRequest, "token_ids.ids", bad,
                            f"the token id at {where}")
        return prompt

    @property
    def echo_logprobs(self) -> bool:
        """echo with logprobs: the prompt's tokens and logprobs come first (vLLM)."""
        return self.echo and self.logprobs is not None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as separate items: one string, or one token-id list, each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_generate(self, prompt: str | list[int], request_id: str) -> router_pb2.GenerateRequest:
        echo_k = self.logprobs if self.echo_logprobs else None
        request = self._prompt_options(router_pb2.GenerateRequest(
            request_id=request_id,
            model=self.model,
            sampling=self._sampling(
                self.max_tokens, self.logprobs,
                prompt_logprobs=_one_k(self.returned_prompt_logprobs, echo_k)),
            cache_salt=self.cache_salt,
            priority=self.priority,
            stream=self.stream,
        ))
        if isinstance(prompt, str):
            request.text = prompt
            request.add_special_tokens = self.add_special_tokens
        else:
            request.token_ids.ids.extend(prompt)
        return request


# -- responses -------------------------------------------------------------------------------------
class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per generated token (with
    echo, per prompt token first; the first prompt token's entries are null)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """A choice as streamed."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponseChoice(CompletionChoice):
    """A choice of a whole (unstreamed) response."""

    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
