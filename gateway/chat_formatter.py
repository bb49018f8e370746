"""/v1/chat/completions' answers, whole and streamed: assistant messages (each streamed choice
opens with its role), chat logprobs, vLLM's `prompt_logprobs` on the response, and the output
read as a reply (gateway/reply.py's `ReplyPlan`): reasoning into `reasoning`, tool calls into
`tool_calls`, whole or as streamed deltas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from pdmesh.gateway.chat_schemas import ChatChunkChoice, ChatCompletionResponse, DeltaMessage
from pdmesh.gateway.formatter import (
    Choice,
    Outputs,
    ResponseHead,
    StreamedDelta,
    sequence_failed,
)
from pdmesh.gateway.openai_format import (
    chat_choice,
    chat_logprobs,
    finish_reason,
    format_prompt_logprobs,
    stop_reason,
    tool_finish_reason,
)
from pdmesh.gateway.reply import ReplyPlan
from pdmesh.gateway.tool_parsers import OutputStream, StreamEvents
from pdmesh.v1 import common_pb2


@dataclass
class ChatFormatter:
    """One chat completions request's answer (a `Formatter`)."""

    operation: ClassVar[str] = "chat"
    chunk_object: ClassVar[str] = "chat.completion.chunk"

    n: int
    want_logprobs: bool
    prompt_logprobs: int | None = None  # k of vLLM's `prompt_logprobs` (None: not asked)
    reply: ReplyPlan = field(default_factory=ReplyPlan)  # reading the output (default: content)
    _readers: dict[int, OutputStream | None] = field(default_factory=dict)  # streamed, per choice

    def whole(self, head: ResponseHead, outputs: Outputs) -> ChatCompletionResponse:
        states, k = outputs.sequences, self.prompt_logprobs
        return ChatCompletionResponse(
            id=head.id, created=head.created, model=head.model, usage=outputs.usage,
            choices=[chat_choice(i, states[i], self.want_logprobs, self.reply)
                     for i in sorted(states)],
            prompt_logprobs=None if k is None else format_prompt_logprobs(
                outputs.prompt_logprobs.get(0, []), k),
        )

    def opening(self) -> list[Choice]:
        """Each choice's role, before its content."""
        return [self._choice(i, DeltaMessage(role="assistant", content=""))
                for i in range(self.n)]

    def prompt_started(
        self, p: int, prompt_logprobs: list[common_pb2.TokenLogprob] | None
    ) -> list[Choice]:
        return []

    def delta(self, index: int, delta: common_pb2.SequenceDelta) -> StreamedDelta:
        reader = self._reader(index)
        if reader is None:
            # `"content": ""` for a token whose text is held back, as vLLM sends it.
            message = DeltaMessage(content=delta.text if delta.text or delta.token_ids else None)
            return StreamedDelta([self._choice(index, message, delta)],
                                 failed=sequence_failed(delta))
        events = _read(reader, delta)
        if not (events.content or events.reasoning or events.tool_calls or delta.logprobs
                or delta.HasField("finish")):
            return StreamedDelta()
        message = DeltaMessage(
            content=events.content or None,
            reasoning=events.reasoning or None,
            tool_calls=[d.to_openai() for d in events.tool_calls] or None,
        )
        # A failed sequence ends the stream with an error event, tool calls or not.
        return StreamedDelta([self._choice(index, message, delta, reader.num_calls > 0)],
                             failed=sequence_failed(delta))

    def _reader(self, index: int) -> OutputStream | None:
        """Choice `index`'s reader (made at its first output); None: plain content."""
        if index not in self._readers:
            self._readers[index] = self.reply.stream()
        return self._readers[index]

    def _choice(self, index: int, message: DeltaMessage,
                delta: common_pb2.SequenceDelta | None = None, called: bool = False) -> Choice:
        finish = delta.finish if delta is not None and delta.HasField("finish") else None
        logprobs = list(delta.logprobs) if delta is not None and self.want_logprobs else None
        choice = ChatChunkChoice(
            index=index, delta=message,
            logprobs=chat_logprobs(logprobs) if logprobs is not None else None,
            finish_reason=tool_finish_reason(finish_reason(finish), called),
            stop_reason=stop_reason(finish),
        ).model_dump(mode="json")
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return choice


def _read(reader: OutputStream, delta: common_pb2.SequenceDelta) -> StreamEvents:
    """A delta's text read; the sequence's last delta also ends the reading."""
    events = reader.feed(delta.text)
    if delta.HasField("finish"):
        rest = reader.finish()
        events.reasoning += rest.reasoning
        events.content += rest.content
        events.tool_calls += rest.tool_calls
    return events
