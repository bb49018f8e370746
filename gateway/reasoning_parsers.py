"""Reasoning parsers: a thinking model's output text → reasoning + content (vLLM's
`--reasoning-parser` and its `reasoning` field).

Every parser here reads the `<think>…</think>` convention; they differ in whether a request
thinks at all, which the chat template decides from its variables (`chat_template_kwargs`, the
server's `--default-chat-template-kwargs` under the request's): DeepSeek-R1 and QwQ always
think, Qwen3 unless `enable_thinking` is false, DeepSeek-V3.1 only with `thinking` true. A
request that does not think is answered as plain content, as vLLM answers it.

A thinking request's output is reasoning up to the end tag and content after it. The template
may have opened the thinking block in the prompt, so the output need not begin with the start
tag; one at its very beginning is dropped. An output that never closes its reasoning (cut by
`max_tokens`) is all reasoning, with no content. Qwen3.5 may open an XML tool call
(`<tool_call>` then `<function=`) inside its thinking: for `qwen3` that ends the reasoning too,
and the call is content, as vLLM reads it. Streamed, `ReasoningStream` holds back only
text that could still be a tag, so any chunking ends with the same reasoning and content as the
whole text, and tool calls are read from the content alone (gateway/reply.py).

With a structured output (`response_format`, a required or named tool), the grammar applies
from the end tag on (`ReasoningParser.grammar_after`): the model thinks freely, then answers in
the grammar, as vLLM constrains a reasoning model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdmesh.gateway.tool_parsers import held_prefix


@dataclass
class ReasoningSplit:
    """What some output text adds to the reasoning and to the content."""

    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True)
class ImplicitEnd:
    """A tag that ends the reasoning without its end tag when `confirm` follows it (past
    whitespace): Qwen3.5 may open a `<tool_call>` inside its thinking. The tag starts the
    content, where the tool parser reads it."""

    tag: str
    confirm: str


@dataclass
class ReasoningStream:
    """One output sequence's text, fed delta by delta, split at the end tag (or an implicit
    end). What could still be a tag, or an implicit end not yet confirmed, is held back."""

    start: str
    end: str
    implicit: ImplicitEnd | None = None
    _buf: str = ""
    _state: str = "head"  # → "reasoning" (past a leading start tag) → "content" (past end)

    def feed(self, delta: str) -> ReasoningSplit:
        self._buf += delta
        return self._scan(final=False)

    def finish(self) -> ReasoningSplit:
        return self._scan(final=True)

    def _scan(self, final: bool) -> ReasoningSplit:
        out = ReasoningSplit()
        if self._state == "head":
            if not final and self.start.startswith(self._buf):
                return out  # could still be the start tag
            if self._buf.startswith(self.start):
                self._buf = self._buf[len(self.start):]
            self._state = "reasoning"
        if self._state == "reasoning":
            end = self._buf.find(self.end)
            cut, skip = (end, len(self.end)) if end >= 0 else (-1, 0)
            pending = self._implicit_end(final, end)
            if pending is not None:
                at, confirmed = pending
                if not confirmed:  # undecided yet: hold it back
                    out.reasoning, self._buf = self._buf[:at], self._buf[at:]
                    return out
                cut, skip = at, 0
            if cut < 0:
                keep = 0 if final else max(held_prefix(self._buf, self.end),
                                           self._held_implicit())
                out.reasoning, self._buf = self._buf[:len(self._buf) - keep], \
                    self._buf[len(self._buf) - keep:]
                return out
            out.reasoning = self._buf[:cut]
            self._buf = self._buf[cut + skip:]
            self._state = "content"
        out.content, self._buf = self._buf, ""
        return out

    def _implicit_end(self, final: bool, end: int) -> tuple[int, bool] | None:
        """The first implicit end before `end` (anywhere when -1): (where, confirmed), with
        confirmed False while the text after it could still become `confirm`."""
        if self.implicit is None:
            return None
        tag, confirm = self.implicit.tag, self.implicit.confirm
        at = self._buf.find(tag)
        while at >= 0 and (end < 0 or at < end):
            after = self._buf[at + len(tag):].lstrip()
            if after.startswith(confirm):
                return at, True
            if not final and confirm.startswith(after):
                return at, False
            at = self._buf.find(tag, at + 1)
        return None

    def _held_implicit(self) -> int:
        return 0 if self.implicit is None else held_prefix(self._buf, self.implicit.tag)


@dataclass(frozen=True)
class ReasoningParser:
    """A named convention: its tags, and the template variable that turns thinking on or off
    (None: the model always thinks)."""

    name: str
    switch: str | None = None
    thinks_by_default: bool = True
    start: str = "<think>"
    end: str = "</think>"
    implicit: ImplicitEnd | None = None

    def thinks(self, template_kwargs: Mapping[str, Any]) -> bool:
        """Whether a request rendered with these template variables thinks."""
        if self.switch is None:
            return True
        value = template_kwargs.get(self.switch, self.thinks_by_default)
        return bool(value)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.start, self.end, self.implicit)

    @property
    def grammar_after(self) -> str:
        """The text after which a thinking request's structured output applies."""
        return self.end


REASONING_PARSERS: dict[str, ReasoningParser] = {p.name: p for p in (
    ReasoningParser("deepseek_r1"),
    ReasoningParser("qwen3", switch="enable_thinking", thinks_by_default=True,
                    implicit=ImplicitEnd("<tool_call>", "<function")),
    ReasoningParser("deepseek_v3", switch="thinking", thinks_by_default=False),
)}


def check_reasoning_parser(name: str | None) -> None:
    """The start-up check of `--reasoning-parser`: a clear error instead of a 400 later."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                         f"got {name!r}")
