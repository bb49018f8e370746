"""/v1/responses' answers, whole and streamed: a response object whose output items are the
reasoning (with --reasoning-parser, for a request that thinks), an assistant message and, with
function tools, the function calls read out of the output (the chat path's `ReplyPlan` reads
them: gateway/reply.py), and, streamed, the Responses API's typed events as vLLM sends them.

A stream is `event: <type>` / `data: <event>` pairs, numbered by `sequence_number`:
response.created and response.in_progress (the response so far), then each output item in
turn, as vLLM's streaming state machine opens and closes them: a message is
response.output_item.added and response.content_part.added, response.output_text.delta per
delta, then response.output_text.done, response.content_part.done and
response.output_item.done; a function call is response.output_item.added (the call, its
arguments empty), response.function_call_arguments.delta per piece, then
response.function_call_arguments.done and response.output_item.done; reasoning is
response.output_item.added, response.reasoning_part.added, response.reasoning_text.delta per
delta, then response.reasoning_text.done, response.reasoning_part.done and
response.output_item.done. Without tools or reasoning the message opens at once; with them an
item opens when its first reasoning, content or call arrives (so a reply that only calls has no
message item), and the next one closes it. response.completed carries the
whole response, its items as streamed, and its usage (status "incomplete" when
max_output_tokens cut it, as vLLM reports it). A failure after the stream started is an
`error` event. No `[DONE]` (neither OpenAI nor vLLM sends one here).

With `include: ["message.output_text.logprobs"]` the output text part's `logprobs` lists each
output token (token, logprob, UTF-8 bytes and its `top_logprobs` alternatives; a logprob is
at least -9999, as vLLM clamps it). Whole, the message lists every output token, as vLLM's
does; streamed, each response.output_text.delta carries the tokens that brought its text (in
the delta shape: no bytes), a token whose text was held back riding with the next delta, and
the closed part lists them all (those of tokens with no text of their own last, so a stream
without tools ends with the whole answer's list); function calls carry none, as in vLLM.
response.output_text.done's `logprobs` stays [] (vLLM's). Not asked for, `logprobs` is null
on the part and [] on the events, as before.

The generation flow (gateway/streaming.py) frames what a formatter streams as chat-style
chunks with `data:` lines only; `ResponsesFormatter.events` re-frames them: the formatter's
events come back out of their chunks with their `event:` line and number, the markers for the
response snapshots are filled in from the chunk's head, and the closing usage chunk becomes
response.completed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fastapi.responses import Response, StreamingResponse

from pdmesh.gateway.errors import GatewayError
from pdmesh.gateway.formatter import (
    Choice,
    Formatter,
    Outputs,
    ResponseHead,
    StreamedDelta,
    sequence_failed,
)
from pdmesh.gateway.openai_format import SequenceState
from pdmesh.gateway.reply import ReplyPlan
from pdmesh.gateway.responses_output import (
    IncompleteDetails,
    OutputFunctionCall,
    OutputItem,
    OutputLogprob,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTopLogprob,
    ReasoningText,
    ResponsesResponse,
    ResponseStatus,
    ResponseUsage,
)
from pdmesh.gateway.responses_schemas import ResponsesRequest, in_responses_terms
from pdmesh.gateway.schemas import UsageInfo
from pdmesh.gateway.streaming import DONE, is_comment, sse_response
from pdmesh.gateway.tool_parsers import OutputStream, StreamEvents, ToolCallDelta
from pdmesh.v1 import common_pb2

_SNAPSHOTS = ("response.created", "response.in_progress")
"""Events that carry the response so far, filled in from the head when re-framed."""

MIN_LOGPROB = -9999.0
"""vLLM's floor for a Responses logprob (-inf is no JSON number)."""


def output_logprobs(entries: list[common_pb2.TokenLogprob], k: int) -> list[OutputLogprob]:
    """The router's per-token logprobs as the output text part lists them, `k` alternatives
    each (the same tokens and values chat's `logprobs.content` gives)."""
    return [OutputLogprob(
        token=lp.text, logprob=max(lp.logprob, MIN_LOGPROB), bytes=_utf8(lp.text),
        top_logprobs=[OutputTopLogprob(token=c.text, logprob=max(c.logprob, MIN_LOGPROB),
                                       bytes=_utf8(c.text)) for c in lp.top[:k]],
    ) for lp in entries]


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def status_of(finish: common_pb2.Finish | None) -> ResponseStatus:
    """vLLM's reading: cut by the length limit is "incomplete", any other end "completed"."""
    if finish is not None and finish.reason == common_pb2.FINISH_REASON_LENGTH:
        return "incomplete"
    return "completed"


@dataclass
class ResponsesFormatter:
    """One /v1/responses request's answer (a `Formatter`; one output sequence). Its items are
    named after the request: `rs_<id>` for the reasoning, `msg_<id>` (`msg_<id>_<n>` for a later
    message), `fc_<id>_<n>` for the n-th call, the same streamed and in the final response."""

    operation: ClassVar[str] = "chat"
    chunk_object: ClassVar[str] = "response"

    request: ResponsesRequest
    request_id: str
    reply: ReplyPlan = field(default_factory=ReplyPlan)  # reading the output (default: text)
    _reader: OutputStream | None = field(init=False, default=None)  # streamed: the reader
    _item: OutputItem | None = None  # streamed: the item open now
    _text: str = ""  # ... its text or arguments so far
    _done: list[OutputItem] = field(default_factory=list)  # ... the items closed, in order
    _messages: int = 0  # ... message items opened
    _logprobs: list[OutputLogprob] = field(default_factory=list)  # ... the open message's
    _pending: list[common_pb2.TokenLogprob] = field(default_factory=list)  # ... not yet sent
    _status: ResponseStatus = "in_progress"

    def __post_init__(self) -> None:
        self._reader = self.reply.stream()

    def reasoning_id(self) -> str:
        return f"rs_{self.request_id}"

    def message_id(self, n: int = 0) -> str:
        return f"msg_{self.request_id}" if n == 0 else f"msg_{self.request_id}_{n}"

    def call_item_id(self, n: int) -> str:
        """The n-th function call item's id (its `call_id` is the parser's)."""
        return f"fc_{self.request_id}_{n}"

    def whole(self, head: ResponseHead, outputs: Outputs) -> ResponsesResponse:
        seq = outputs.sequences.get(0, SequenceState())
        k = self.request.output_logprobs()
        logprobs = (output_logprobs(seq.logprobs, k) or None) if k is not None else None
        return self.response(head, status_of(seq.finish), self._items(seq.text, logprobs),
                             ResponseUsage.of(outputs.usage))

    def _items(self, text: str, logprobs: list[OutputLogprob] | None) -> list[OutputItem]:
        """The output items of a whole text: the reasoning, the message (with every token's
        `logprobs`, as vLLM's), then the calls read out of it; with a reader the message only
        when there is content besides the reasoning and calls (vLLM's)."""
        if self._reader is None:
            return [_message(self.message_id(), text, "completed", logprobs)]
        read = self.reply.read(text)
        items: list[OutputItem] = [] if read.reasoning is None else [
            _reasoning(self.reasoning_id(), read.reasoning, "completed")]
        if read.content:
            items.append(_message(self.message_id(), read.content, "completed", logprobs))
        return [*items, *(OutputFunctionCall(id=self.call_item_id(n), call_id=c.id,
                                             name=c.name, arguments=c.arguments,
                                             status="completed")
                          for n, c in enumerate(read.tool_calls))]

    def response(self, head: ResponseHead, status: ResponseStatus, output: list[OutputItem],
                 usage: ResponseUsage | None = None) -> ResponsesResponse:
        """The response object with `output` (a snapshot: [], no output yet)."""
        req = self.request
        fmt = req.text.model_dump(mode="json", by_alias=True, exclude_none=True) \
            if req.text is not None else None
        choice = req.effective_tool_choice()
        return ResponsesResponse(
            id=head.id, created_at=head.created, model=head.model, status=status,
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete" else None,
            output=output,
            instructions=req.instructions, metadata=req.metadata, user=req.user,
            temperature=req.temperature, top_p=req.top_p,
            max_output_tokens=req.max_output_tokens, text=fmt, usage=usage,
            top_logprobs=req.output_logprobs(),
            tools=[t.model_dump(mode="json") for t in req.tools],
            tool_choice=choice if isinstance(choice, str) else choice.model_dump(mode="json"),
            parallel_tool_calls=req.parallel_tool_calls is not False,
        )

    # -- streamed ----------------------------------------------------------------------------------
    def opening(self) -> list[Choice]:
        """The response's snapshots (markers), then, read as plain text, the message item and
        its text part (otherwise the first item opens when its output arrives)."""
        markers: list[Choice] = [{"type": kind} for kind in _SNAPSHOTS]
        return markers if self._reader is not None else [*markers, *self._open_message()]

    def prompt_started(
        self, p: int, prompt_logprobs: list[common_pb2.TokenLogprob] | None
    ) -> list[Choice]:
        return []

    def delta(self, index: int, delta: common_pb2.SequenceDelta) -> StreamedDelta:
        failed = sequence_failed(delta)
        ends = delta.HasField("finish") and not failed
        if self.request.output_logprobs() is not None:
            self._pending += delta.logprobs
        if self._reader is None:
            reads = [StreamEvents(content=delta.text)]
        else:
            reads = [self._reader.feed(delta.text), *([self._reader.finish()] if ends else [])]
        events: list[Choice] = []
        for read in reads:
            if read.reasoning:
                events += self._reasoning(read.reasoning)
            if read.content:
                events += self._content(read.content)
            for call in read.tool_calls:
                events += self._call(call)
        if failed:  # the stream ends with an error event instead
            return StreamedDelta(events, failed=True)
        if ends:
            self._status = status_of(delta.finish)
            events += self._close()
        return StreamedDelta(events)

    def _output_index(self) -> int:
        return len(self._done)

    def _open_message(self) -> list[Choice]:
        self._item = _message(self.message_id(self._messages), "", "in_progress")
        self._messages += 1
        self._text = ""
        self._logprobs = []
        part = OutputText(text="", logprobs=[]).model_dump(mode="json")
        return [
            {"type": "response.output_item.added", "output_index": self._output_index(),
             "item": self._item.model_dump(mode="json")},
            {"type": "response.content_part.added", "item_id": self._item.id,
             "output_index": self._output_index(), "content_index": 0, "part": part},
        ]

    def _reasoning(self, text: str) -> list[Choice]:
        """Reasoning text: into the open reasoning item, else one opened after the item before
        (its tokens carry no logprobs, as a call's)."""
        events: list[Choice] = []
        self._pending = []
        if not isinstance(self._item, OutputReasoning):
            events += self._close()
            self._item = _reasoning(self.reasoning_id(), "", "in_progress")
            self._text = ""
            events += [
                {"type": "response.output_item.added", "output_index": self._output_index(),
                 "item": self._item.model_dump(mode="json")},
                {"type": "response.reasoning_part.added", "item_id": self._item.id,
                 "output_index": self._output_index(), "content_index": 0,
                 "part": ReasoningText(text="").model_dump(mode="json")}]
        self._text += text
        return [*events, {"type": "response.reasoning_text.delta", "item_id": self._item.id,
                          "output_index": self._output_index(), "content_index": 0,
                          "delta": text}]

    def _content(self, text: str) -> list[Choice]:
        """Content text: into the open message, else a message opened after the item before."""
        events = [] if isinstance(self._item, OutputMessage) else \
            [*self._close(), *self._open_message()]
        assert self._item is not None
        self._text += text
        logprobs = self._take_logprobs()
        return [*events, {"type": "response.output_text.delta", "item_id": self._item.id,
                          "output_index": self._output_index(), "content_index": 0,
                          "delta": text, "logprobs": [lp.streamed() for lp in logprobs]}]

    def _take_logprobs(self) -> list[OutputLogprob]:
        """The tokens not yet sent, now part of the open message's list (none when not
        asked for)."""
        k = self.request.output_logprobs()
        if k is None or not self._pending:
            return []
        taken = output_logprobs(self._pending, k)
        self._pending = []
        self._logprobs += taken
        return taken

    def _part_logprobs(self) -> list[OutputLogprob] | None:
        """The open message's list for its part: null when not asked for or empty (vLLM's)."""
        return self._logprobs or None

    def _call(self, call: ToolCallDelta) -> list[Choice]:
        """A tool-call delta: a new call (its id and name) closes the item before and opens
        its own; later ones are pieces of its arguments."""
        events: list[Choice] = []
        self._pending = []  # a call's tokens: no logprobs (vLLM's)
        if call.id is not None:
            events += self._close()
            self._item = OutputFunctionCall(
                id=self.call_item_id(call.index), call_id=call.id, name=call.name or "",
                arguments="", status="in_progress")
            self._text = ""
            events.append({"type": "response.output_item.added",
                           "output_index": self._output_index(),
                           "item": self._item.model_dump(mode="json")})
        if call.arguments and self._item is not None:
            self._text += call.arguments
            events.append({"type": "response.function_call_arguments.delta",
                           "item_id": self._item.id, "output_index": self._output_index(),
                           "delta": call.arguments})
        return events

    def _close(self) -> list[Choice]:
        """The open item's closing events (none when no item is open)."""
        item, index = self._item, self._output_index()
        if item is None:
            return []
        self._item = None
        if isinstance(item, OutputFunctionCall):
            done: OutputItem = item.model_copy(update={"arguments": self._text,
                                                       "status": "completed"})
            events: list[Choice] = [
                {"type": "response.function_call_arguments.done", "item_id": item.id,
                 "output_index": index, "name": item.name, "arguments": self._text}]
        elif isinstance(item, OutputReasoning):
            done = _reasoning(item.id, self._text, "completed")
            part = ReasoningText(text=self._text).model_dump(mode="json")
            events = [
                {"type": "response.reasoning_text.done", "item_id": item.id,
                 "output_index": index, "content_index": 0, "text": self._text},
                {"type": "response.reasoning_part.done", "item_id": item.id,
                 "output_index": index, "content_index": 0, "part": part}]
        else:
            self._take_logprobs()  # tokens without text of their own (the last, say)
            done = _message(item.id, self._text, "completed", self._part_logprobs())
            part = OutputText(text=self._text, logprobs=self._part_logprobs())
            events = [
                {"type": "response.output_text.done", "item_id": item.id,
                 "output_index": index, "content_index": 0, "text": self._text,
                 "logprobs": []},
                {"type": "response.content_part.done", "item_id": item.id,
                 "output_index": index, "content_index": 0,
                 "part": part.model_dump(mode="json")}]
        self._done.append(done)
        return [*events, {"type": "response.output_item.done", "output_index": index,
                          "item": done.model_dump(mode="json")}]

    def _streamed_output(self) -> list[OutputItem]:
        """The items streamed, for response.completed (one still open as it stands)."""
        item = self._item
        if isinstance(item, OutputFunctionCall):
            item = item.model_copy(update={"arguments": self._text})
        elif isinstance(item, OutputReasoning):
            item = _reasoning(item.id, self._text, "in_progress")
        elif item is not None:
            item = _message(item.id, self._text, "in_progress", self._part_logprobs())
        return [*self._done, *([item] if item is not None else [])]

    async def events(self, chunks: AsyncIterable[str | bytes]) -> AsyncIterator[str]:
        """The generation flow's SSE chunks (gateway/streaming.py) as Responses events."""
        number = 0
        try:
            async for chunk in chunks:
                if is_comment(chunk):  # a keep-alive: passed on as it is
                    yield chunk.decode() if isinstance(chunk, bytes) else chunk
                    continue
                for event in self.reframe(chunk):
                    yield sse_typed_event({**event, "sequence_number": number})
                    number += 1
        finally:
            close = getattr(chunks, "aclose", None)
            if close is not None:  # the flow's own end (its calls closed, its metrics)
                await close()

    def reframe(self, chunk: str | bytes) -> list[dict[str, Any]]:
        """One SSE chunk of the generation flow → the Responses events it stands for."""
        text = chunk.decode() if isinstance(chunk, bytes) else chunk
        if text == DONE:
            return []
        body = json.loads(text.removeprefix("data: "))
        if "error" in body:
            error, code = body["error"], body["error"].get("code")
            return [{"type": "error", "code": None if code is None else str(code),
                     "message": error.get("message", ""), "param": error.get("param")}]
        head = ResponseHead(id=body["id"], created=body["created"], model=body["model"])
        if not body["choices"]:  # the closing usage chunk
            usage = ResponseUsage.of(UsageInfo.model_validate(body["usage"] or {}))
            done = self.response(head, self._status, self._streamed_output(), usage)
            return [{"type": "response.completed", "response": done.model_dump(mode="json")}]
        events = []
        for event in body["choices"]:
            if event["type"] in _SNAPSHOTS:
                snapshot = self.response(head, "in_progress", [])
                event = {**event, "response": snapshot.model_dump(mode="json")}
            events.append(event)
        return events


def _message(item_id: str, text: str, status: ResponseStatus,
             logprobs: list[OutputLogprob] | None = None) -> OutputMessage:
    return OutputMessage(id=item_id, status=status,
                         content=[OutputText(text=text, logprobs=logprobs)] if text else [])


def _reasoning(item_id: str, text: str, status: ResponseStatus) -> OutputReasoning:
    return OutputReasoning(id=item_id, status=status,
                           content=[ReasoningText(text=text)] if text else [])


def sse_typed_event(event: dict[str, Any]) -> str:
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n"


async def responses_answer(answering: Awaitable[Response], formatter: Formatter) -> Response:
    """The generation flow's answer (gateway/serving.py) as /v1/responses sends it: a whole
    response as it is, a stream re-framed into Responses events, a refusal naming this body's
    fields."""
    if not isinstance(formatter, ResponsesFormatter):
        raise TypeError(f"not a /v1/responses plan's formatter: {formatter!r}")
    try:
        answer = await answering
    except GatewayError as exc:
        raise in_responses_terms(exc, formatter.request) from None
    if isinstance(answer, StreamingResponse):
        return sse_response(formatter.events(answer.body_iterator))
    return answer
