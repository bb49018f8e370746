"""vLLM's `--enable-log-requests`, `--enable-log-outputs` and `--max-log-len`: a log line per
request as the router admits it and, with outputs, one per sequence as it ends.

Off by default: prompts and outputs are the users' data. Turned on, the lines go to the
`pdmesh.requests` logger at INFO whatever `--log-level` says (asking for them is asking to see
them); the prompt's token ids at DEBUG, as vLLM logs the prompt. `--max-log-len` caps the
characters of a text and the count of ids a line shows. Every line names the request id, the
one the client got in X-Request-Id, so it joins the traces and the router's own request line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from google.protobuf import text_format

from pdmesh.v1 import common_pb2, router_pb2

LOGGER = logging.getLogger("pdmesh.requests")


@dataclass(frozen=True)
class RequestLog:
    """What the router logs of each request (`from_flags`: None when nothing)."""

    outputs: bool = False
    max_len: int | None = None

    @classmethod
    def from_flags(cls, requests: bool, outputs: bool,
                   max_len: int | None) -> RequestLog | None:
        """The log the flags ask for, with its logger opened at INFO; None for none."""
        if not requests:
            return None
        if not LOGGER.isEnabledFor(logging.INFO):
            LOGGER.setLevel(logging.INFO)
        return cls(outputs, max_len)

    def received(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                 sampling: common_pb2.SamplingParams) -> None:
        LOGGER.info("received request_id=%s prompt_tokens=%d max_tokens=%d params={%s}",
                    request_id, len(prompt_token_ids), max_tokens,
                    text_format.MessageToString(sampling, as_one_line=True))
        if LOGGER.isEnabledFor(logging.DEBUG):
            LOGGER.debug("prompt request_id=%s prompt_token_ids=%s", request_id,
                         self._cut_ids(prompt_token_ids))

    def output(self, request_id: str) -> OutputLog | None:
        """What follows one request's output, when outputs are logged."""
        return OutputLog(request_id, self) if self.outputs else None

    def cut_text(self, text: str) -> str:
        if self.max_len is None or len(text) <= self.max_len:
            return text
        return text[:self.max_len] + "..."

    def _cut_ids(self, ids: list[int]) -> str:
        if self.max_len is None or len(ids) <= self.max_len:
            return str(ids)
        return f"{ids[:self.max_len]}..."


@dataclass
class OutputLog:
    """One request's sequences as its deltas pass; a line per sequence as it finishes."""

    request_id: str
    log: RequestLog
    texts: dict[int, list[str]] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)

    def saw(self, message: router_pb2.GenerateResponse) -> None:
        if message.WhichOneof("event") != "delta":
            return
        delta = message.delta
        self.texts.setdefault(delta.index, []).append(delta.text)
        self.tokens[delta.index] = self.tokens.get(delta.index, 0) + len(delta.token_ids)
        if delta.HasField("finish"):
            reason = common_pb2.FinishReason.Name(delta.finish.reason).removeprefix(
                "FINISH_REASON_").lower()
            LOGGER.info("finished request_id=%s index=%d finish_reason=%s output_tokens=%d "
                        "output=%r", self.request_id, delta.index, reason,
                        self.tokens[delta.index],
                        self.log.cut_text("".join(self.texts.pop(delta.index))))
