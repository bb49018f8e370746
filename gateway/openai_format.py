"""Router messages → OpenAI objects: finish reasons, logprobs and whole choices.

Pure functions over the protobuf messages, so every format detail is unit-testable without a
mesh. `SequenceState` accumulates the deltas of one output sequence (router.proto: their
concatenation is the whole output).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdmesh.gateway.chat_schemas import (
    ChatChoice,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    FunctionCallOut,
    ToolCallOut,
    TopLogprob,
)
from pdmesh.gateway.completion_schemas import CompletionLogprobs, CompletionResponseChoice
from pdmesh.gateway.reply import ReplyPlan
from pdmesh.gateway.schemas import PromptLogprob, PromptLogprobs
from pdmesh.v1 import common_pb2

_FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


def finish_reason(finish: common_pb2.Finish | None) -> str | None:
    if finish is None:
        return None
    return _FINISH_REASONS.get(finish.reason)


def stop_reason(finish: common_pb2.Finish | None) -> str | int | None:
    """vLLM's extension: the stop string or token id that ended the sequence, if any."""
    if finish is None:
        return None
    which = finish.WhichOneof("stop_reason")
    return getattr(finish, which) if which else None


def completion_logprobs(
    logprobs: list[common_pb2.TokenLogprob], text_offset: int = 0, k: int | None = None
) -> CompletionLogprobs:
    """The legacy format. `text_offset` is where the first token starts in the choice's text;
    offsets add up token texts, which is exact except around held-back partial characters.
    `k` keeps that many alternatives (the router computed more for another answer)."""
    out = CompletionLogprobs()
    offset = text_offset
    for lp in logprobs:
        out.tokens.append(lp.text)
        out.token_logprobs.append(lp.logprob)
        top = {c.text: c.logprob for c in lp.top[:k]}
        top.setdefault(lp.text, lp.logprob)  # like OpenAI: the sampled token is always listed
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(lp.text)
    return out


def echo_logprobs(
    first_token: str, prompt: list[common_pb2.TokenLogprob],
    output: list[common_pb2.TokenLogprob], output_offset: int, k: int | None = None,
) -> CompletionLogprobs:
    """`echo` with logprobs, as vLLM answers it: the prompt's tokens first (the first has no
    context, so its logprob and alternatives are null; `prompt` holds the rest, from the
    engine's prompt logprobs, of which `k` alternatives are kept), then the output's, whose
    text starts at `output_offset`."""
    head = completion_logprobs(prompt, len(first_token), k)
    tail = completion_logprobs(output, output_offset)
    return CompletionLogprobs(
        tokens=[first_token, *head.tokens, *tail.tokens],
        token_logprobs=[None, *head.token_logprobs, *tail.token_logprobs],
        top_logprobs=[None, *head.top_logprobs, *tail.top_logprobs],
        text_offset=[0, *head.text_offset, *tail.text_offset],
    )


def format_prompt_logprobs(entries: list[common_pb2.TokenLogprob], k: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` from the router's (entry i = prompt token i + 1): null for the
    first token, then per token its own logprob and the `k` most likely tokens', by id."""
    out: PromptLogprobs = [None]
    for lp in entries:
        position = {lp.token_id: PromptLogprob(logprob=lp.logprob, rank=lp.rank or None,
                                               decoded_token=lp.text)}
        for rank, c in enumerate(lp.top[:k], 1):
            position.setdefault(c.token_id, PromptLogprob(logprob=c.logprob, rank=rank,
                                                          decoded_token=c.text))
        out.append(position)
    return out


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(logprobs: list[common_pb2.TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=lp.text,
                logprob=lp.logprob,
                bytes=_utf8(lp.text),
                top_logprobs=[
                    TopLogprob(token=c.text, logprob=c.logprob, bytes=_utf8(c.text))
                    for c in lp.top
                ],
            )
            for lp in logprobs
        ]
    )


@dataclass
class SequenceState:
    """One output sequence, as accumulated from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish: common_pb2.Finish | None = None

    def add(self, delta: common_pb2.SequenceDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.HasField("finish"):
            self.finish = delta.finish


def completion_choice(
    index: int, seq: SequenceState, want_logprobs: bool
) -> CompletionResponseChoice:
    return CompletionResponseChoice(
        index=index,
        text=seq.text,
        logprobs=completion_logprobs(seq.logprobs) if want_logprobs else None,
        finish_reason=finish_reason(seq.finish),
        stop_reason=stop_reason(seq.finish),
    )


def chat_choice(
    index: int, seq: SequenceState, want_logprobs: bool, reply: ReplyPlan | None = None
) -> ChatChoice:
    """One chat choice; the output read as `reply` says: reasoning split into `reasoning`, tool
    calls into `tool_calls` (finish reason "tool_calls" when it made any and stopped by
    itself)."""
    read = (reply or ReplyPlan()).read(seq.text)
    message = ChatMessageOut(content=read.content, reasoning=read.reasoning, tool_calls=[
        ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
        for c in read.tool_calls])
    return ChatChoice(
        index=index,
        message=message,
        logprobs=chat_logprobs(seq.logprobs) if want_logprobs else None,
        finish_reason=tool_finish_reason(finish_reason(seq.finish), bool(read.tool_calls)),
        stop_reason=stop_reason(seq.finish),
    )


def tool_finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an output that made calls and ended by itself."""
    return "tool_calls" if called and reason == "stop" else reason
