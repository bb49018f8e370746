"""pythonic (Llama 3.2, Llama 4 and others): the reply is a Python list of calls with keyword
arguments of literal values, `[get_weather(city="Paris"), get_time(zone=2)]`, optionally inside
Llama 4's `<|python_start|>` … `<|python_end|>`. A reply that does not start with the list is
content.

The list is read with `ast` (parsed, never run; each argument through `ast.literal_eval`) once,
at its closing bracket: brackets are counted outside string literals as the text arrives, each
character read once, so a long output costs one pass whatever its chunking. Text after the
list is content. Arguments that have no JSON form (a set, bytes, a complex number) make the
whole reply content, as any other malformed list does.
"""

from __future__ import annotations

import ast
import json

from pdmesh.gateway.tool_parsers.stream import Scanner, Segment, ToolCall, ToolParser

START, END = "<|python_start|>", "<|python_end|>"


def parse_call_list(text: str) -> list[ToolCall] | None:
    """`[f(a=1), g()]` → its calls; None when `text` is anything else."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.List) or not node.elts:
        return None
    calls = []
    for element in node.elts:
        if not isinstance(element, ast.Call) or not isinstance(element.func, ast.Name) \
                or element.args:
            return None
        arguments = {}
        for keyword in element.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        try:
            calls.append(ToolCall(element.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (TypeError, ValueError, RecursionError):  # no JSON form
            return None
    return calls


class _ListEnd:
    """Finds where a Python list literal that opens at the start of the text closes, reading
    each character once however the text arrives: brackets counted outside string literals."""

    def __init__(self, start: int) -> None:
        self.pos = start  # the next character to read: the list's `[` first
        self.depth = 0
        self.quote = ""  # the open string's quote character, "" outside strings
        self.escaped = False

    def find(self, text: str) -> int:
        """The index of the closing `]` in `text` (which only grows between calls), or -1
        while the text has not reached it."""
        while self.pos < len(text):
            c = text[self.pos]
            self.pos += 1
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == self.quote:
                    self.quote = ""
            elif c in "'\"":
                self.quote = c
            elif c in "([{":
                self.depth += 1
            elif c in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    return self.pos - 1
        return -1


class _PythonicScanner(Scanner):
    def __init__(self) -> None:
        self.buf = ""
        self.mode = "undecided"  # → "calls" (→ "after" the list) or "content"
        self.opened = 0  # where the list's `[` is
        self.list_end = _ListEnd(0)

    def scan(self, delta: str, final: bool) -> list[Segment]:
        self.buf += delta
        if self.mode == "undecided":
            head = self.buf.lstrip().removeprefix(START).lstrip()
            if head.startswith("["):
                self.mode = "calls"
                self.opened = self.buf.index("[")
                self.list_end = _ListEnd(self.opened)
            elif not final and (not head or START.startswith(self.buf.lstrip())):
                return []
            else:
                self.mode = "content"
        if self.mode == "calls":
            return self._calls(final)
        if self.mode == "after":
            return self._after(final)
        text, self.buf = self.buf, ""
        return [text] if text else []

    def _calls(self, final: bool) -> list[Segment]:
        """At the list's closing bracket, its calls (or, when it is no list of calls, all of
        it as content); parsed once, however long the output."""
        end = self.list_end.find(self.buf)
        if end >= 0:
            calls = parse_call_list(self.buf[self.opened:end + 1])
            if calls is not None:
                self.buf, self.mode = self.buf[end + 1:], "after"
                return [*calls, *self._after(final)]
        elif not final:
            return []
        text, self.buf, self.mode = self.buf, "", "content"
        return [text]

    def _after(self, final: bool) -> list[Segment]:
        """The text after the list: content, less a closing `<|python_end|>`."""
        head = self.buf.lstrip()
        if not final and (not head or (END.startswith(head) and head != END)):
            return []  # only whitespace yet, or the closing tag may be arriving
        text = head[len(END):] if head.startswith(END) else self.buf
        self.buf, self.mode = "", "content"
        return [text] if text else []


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def scanner(self) -> Scanner:
        return _PythonicScanner()


class Llama4PythonicToolParser(PythonicToolParser):
    """vLLM's name for the same format as Llama 4 writes it."""

    name = "llama4_pythonic"
