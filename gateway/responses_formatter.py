"""/v1/responses' answers, whole and streamed: a response object with one assistant message
item, and, streamed, the Responses API's typed events as vLLM sends them.

A stream is `event: <type>` / `data: <event>` pairs, numbered by `sequence_number`:
response.created and response.in_progress (the response so far), response.output_item.added
and response.content_part.added (the message and its text part, opened at once),
response.output_text.delta per delta, then response.output_text.done,
response.content_part.done and response.output_item.done when the sequence finishes, and
response.completed with the whole response and its usage (status "incomplete" when
max_output_tokens cut it, as vLLM reports it). A failure after the stream started is an
`error` event. No `[DONE]` (neither OpenAI nor vLLM sends one here).

The generation flow (gateway/streaming.py) frames what a formatter streams as chat-style
chunks with `data:` lines only; `ResponsesFormatter.events` re-frames them: the formatter's
events come back out of their chunks with their `event:` line and number, the markers for the
response snapshots are filled in from the chunk's head, and the closing usage chunk becomes
response.completed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable
from dataclasses import dataclass
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
from pdmesh.gateway.responses_schemas import (
    IncompleteDetails,
    OutputMessage,
    OutputText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseStatus,
    ResponseUsage,
    in_responses_terms,
)
from pdmesh.gateway.schemas import UsageInfo
from pdmesh.gateway.streaming import DONE, sse_response
from pdmesh.v1 import common_pb2

_SNAPSHOTS = ("response.created", "response.in_progress")
"""Events that carry the response so far, filled in from the head when re-framed."""


def status_of(finish: common_pb2.Finish | None) -> ResponseStatus:
    """vLLM's reading: cut by the length limit is "incomplete", any other end "completed"."""
    if finish is not None and finish.reason == common_pb2.FINISH_REASON_LENGTH:
        return "incomplete"
    return "completed"


@dataclass
class ResponsesFormatter:
    """One /v1/responses request's answer (a `Formatter`; one output sequence)."""

    operation: ClassVar[str] = "chat"
    chunk_object: ClassVar[str] = "response"

    request: ResponsesRequest
    item_id: str  # the message item's id, the same streamed and in the final response
    _text: str = ""  # streamed so far
    _status: ResponseStatus = "in_progress"

    def whole(self, head: ResponseHead, outputs: Outputs) -> ResponsesResponse:
        seq = outputs.sequences.get(0, SequenceState())
        return self.response(head, status_of(seq.finish), seq.text,
                             ResponseUsage.of(outputs.usage))

    def response(self, head: ResponseHead, status: ResponseStatus, text: str | None,
                 usage: ResponseUsage | None = None) -> ResponsesResponse:
        """The response object; `text` None: no output yet."""
        req = self.request
        fmt = req.text.model_dump(mode="json", by_alias=True, exclude_none=True) \
            if req.text is not None else None
        return ResponsesResponse(
            id=head.id, created_at=head.created, model=head.model, status=status,
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete" else None,
            output=[] if text is None else [self._message(text, "completed")],
            instructions=req.instructions, metadata=req.metadata, user=req.user,
            temperature=req.temperature, top_p=req.top_p,
            max_output_tokens=req.max_output_tokens, text=fmt, usage=usage,
        )

    def _message(self, text: str, status: ResponseStatus) -> OutputMessage:
        return OutputMessage(id=self.item_id, status=status,
                             content=[OutputText(text=text)] if text else [])

    # -- streamed ----------------------------------------------------------------------------------
    def opening(self) -> list[Choice]:
        """The response's snapshots (markers), then the message item and its text part."""
        part = OutputText(text="", logprobs=[]).model_dump(mode="json")
        return [
            *({"type": kind} for kind in _SNAPSHOTS),
            {"type": "response.output_item.added", "output_index": 0,
             "item": self._message("", "in_progress").model_dump(mode="json")},
            {"type": "response.content_part.added", "item_id": self.item_id,
             "output_index": 0, "content_index": 0, "part": part},
        ]

    def prompt_started(
        self, p: int, prompt_logprobs: list[common_pb2.TokenLogprob] | None
    ) -> list[Choice]:
        return []

    def delta(self, index: int, delta: common_pb2.SequenceDelta) -> StreamedDelta:
        events: list[Choice] = []
        if delta.text:
            self._text += delta.text
            events.append({"type": "response.output_text.delta", "item_id": self.item_id,
                           "output_index": 0, "content_index": 0, "delta": delta.text,
                           "logprobs": []})
        if sequence_failed(delta):  # the stream ends with an error event instead
            return StreamedDelta(events, failed=True)
        if delta.HasField("finish"):
            self._status = status_of(delta.finish)
            part = OutputText(text=self._text).model_dump(mode="json")
            events += [
                {"type": "response.output_text.done", "item_id": self.item_id,
                 "output_index": 0, "content_index": 0, "text": self._text, "logprobs": []},
                {"type": "response.content_part.done", "item_id": self.item_id,
                 "output_index": 0, "content_index": 0, "part": part},
                {"type": "response.output_item.done", "output_index": 0,
                 "item": self._message(self._text, "completed").model_dump(mode="json")},
            ]
        return StreamedDelta(events)

    async def events(self, chunks: AsyncIterable[str | bytes]) -> AsyncIterator[str]:
        """The generation flow's SSE chunks (gateway/streaming.py) as Responses events."""
        number = 0
        try:
            async for chunk in chunks:
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
            done = self.response(head, self._status, self._text, usage)
            return [{"type": "response.completed", "response": done.model_dump(mode="json")}]
        events = []
        for event in body["choices"]:
            if event["type"] in _SNAPSHOTS:
                snapshot = self.response(head, "in_progress", None)
                event = {**event, "response": snapshot.model_dump(mode="json")}
            events.append(event)
        return events


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
