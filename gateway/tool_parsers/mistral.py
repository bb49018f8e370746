"""mistral (Mistral 7B Instruct v0.3, Mistral Small, Magistral): content, then `[TOOL_CALLS]` and
the calls, either as one JSON array of `{"name": ..., "arguments": {...}}` (tokenizer v3) or as
`name[ARGS]{...}` per call, each after its own `[TOOL_CALLS]` (v11 and later).

`[TOOL_CALLS]` is a special token, so a request with tools under this parser is detokenized
with `skip_special_tokens` off (`keeps_special_tokens`), as vLLM does. Mistral's chat templates
accept only 9-character alphanumeric tool call ids in the history a client sends back, so calls
get such ids. Calls that do not parse leave the text from the first `[TOOL_CALLS]` as content.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import string

from pdmesh.gateway.tool_parsers.stream import (
    Scanner,
    Segment,
    ToolCall,
    ToolParser,
    call_of,
    held_prefix,
)

TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_ALPHABET = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


def _with_id(call: ToolCall) -> ToolCall:
    return dataclasses.replace(call, id=mistral_call_id())


class _MistralScanner(Scanner):
    """Content up to the first tag; then, call by call, each complete call as soon as its JSON
    closes. Whatever follows the calls that is no next call is content."""

    def __init__(self) -> None:
        self.buf = ""
        self.mode = "content"  # → "calls" at the first tag → "rest" (content) after them

    def scan(self, delta: str, final: bool) -> list[Segment]:
        self.buf += delta
        out: list[Segment] = []
        if self.mode == "content":
            start = self.buf.find(TAG)
            if start < 0:
                keep = 0 if final else held_prefix(self.buf, TAG)
                text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return [text] if text else []
            out.append(self.buf[:start])
            self.buf, self.mode = self.buf[start:], "calls"
        while self.mode == "calls":
            rest = self.buf.lstrip()
            if not final and (not rest or (TAG.startswith(rest) and rest != TAG)):
                break  # the next tag may be arriving
            if not rest.startswith(TAG):
                self.mode = "rest"
                break
            step = _next_calls(rest[len(TAG):].lstrip())
            if step is None:  # incomplete, or malformed: known at the end
                if final:
                    self.mode = "rest"
                break
            calls, self.buf = step
            out += calls
        if self.mode == "rest":
            out.append(self.buf)
            self.buf = ""
        return [s for s in out if s != ""]


def _next_calls(text: str) -> tuple[list[ToolCall], str] | None:
    """The calls after one tag, and the text after them; None while they do not parse."""
    decoder = json.JSONDecoder()
    if text.startswith("["):  # v3: one array of call objects
        if "]" not in text:
            return None  # cannot be complete yet: not worth a decode
        try:
            array, end = decoder.raw_decode(text)
        except json.JSONDecodeError:
            return None
        found = [call_of(obj, ("arguments",)) for obj in array] if isinstance(array, list) \
            else []
        if not found or any(c is None for c in found):
            return None
        return [_with_id(c) for c in found if c is not None], text[end:]
    name, sep, after = text.partition(ARGS)  # v11: name[ARGS]{...}
    after = after.lstrip()
    if not sep or not after.startswith("{") or "}" not in after:
        return None
    try:
        arguments, end = decoder.raw_decode(after)
    except json.JSONDecodeError:
        return None
    call = call_of({"name": name.strip(), "arguments": arguments}, ("arguments",))
    return None if call is None else ([_with_id(call)], after[end:])


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def scanner(self) -> Scanner:
        return _MistralScanner()
