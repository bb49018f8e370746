"""Structured outputs: the request's spec, and the limits every spec must keep.

`StructuredOutput` is plain data (part of `SamplingParams`), validated where it is built: the
kind and the documented size limits below, checked before anything compiles, in every process
(gateway-built protos pass the router's and the engine's codec through this one class).
Whether a spec compiles, and within its time budget, is the grammar sandbox's verdict
(`grammar_sandbox.py`; the router asks it before admitting a request, the engine before
compiling); compiling and masking live in `grammar.py`. This module imports neither torch nor
xgrammar.

Limits (each error names the limit):
- a `json_schema`, `regex` or `grammar` spec of at most `MAX_SPEC_BYTES` UTF-8 bytes, and a
  `choice` list of at most `MAX_CHOICES` entries and `MAX_SPEC_BYTES` in all;
- compiling within `--structured-output-compile-timeout-s` (default
  `DEFAULT_COMPILE_TIMEOUT_S`), enforced by the sandbox.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

GRAMMAR_CACHE_SIZE = 128
"""Compiled grammars kept per engine (and tokenizer-free grammars per process), by spec."""

MAX_SPEC_BYTES = 64 * 1024
"""A spec's text. Big enough for tool sets of dozens of functions; a spec's compile cost grows
faster than its size, and the budget, not this, is what bounds it."""

MAX_CHOICES = 1024

DEFAULT_COMPILE_TIMEOUT_S = 10.0
"""The time a spec may take to compile against the vocabulary before it is refused. Realistic
schemas compile in milliseconds; 1,000 optional properties take ~3 s on one core."""

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

MAX_REASONING_END_BYTES = 256
"""`reasoning_end`: a tag such as "</think>", not a passage."""


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of the fields is set; names follow vLLM's StructuredOutputsParams.

    `json_schema` is a JSON schema as JSON text (a dict is accepted and serialized);
    `json_object` asks for any JSON object; `choice` lists the only allowed outputs;
    `grammar` is EBNF in xgrammar's dialect with a `root` rule. `reasoning_end`, when set, is a
    reasoning model's end-of-thinking text: the output is free until it has produced that text
    and follows the constraint from the next token on (vLLM's structured outputs under a
    reasoning parser). It is no part of the compiled grammar (`key`).
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    reasoning_end: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema, sort_keys=True))
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, list | tuple):
                raise ValueError("structured_output.choice must be a list of strings")
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_output.choice must be a non-empty list of "
                                 "non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json_schema", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_output.{name} must be a non-empty string")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_output.json_object must be a bool")
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"structured_output must set exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(set_kinds) or 'none'}")
        _check_limits(self.kind, getattr(self, self.kind))
        _check_reasoning_end(self.reasoning_end)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, Any]:
        """Hashable (kind, spec): the compile-cache key."""
        return self.kind, getattr(self, self.kind)


def _check_reasoning_end(text: object) -> None:
    if not isinstance(text, str):
        raise ValueError("structured_output.reasoning_end must be a string")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError("structured_output.reasoning_end is not valid Unicode") from None
    if size > MAX_REASONING_END_BYTES:
        raise ValueError(f"structured_output.reasoning_end is {size} bytes; the limit is "
                         f"{MAX_REASONING_END_BYTES} bytes")


def _check_limits(kind: str, value: Any) -> None:
    """The documented size limits (module docstring), before anything compiles."""
    if kind == "json_object":
        return
    texts = value if kind == "choice" else (value,)
    if kind == "choice" and len(texts) > MAX_CHOICES:
        raise ValueError(f"structured_output.choice has {len(texts)} entries; the limit is "
                         f"{MAX_CHOICES}")
    try:
        size = sum(len(t.encode("utf-8")) for t in texts)
    except UnicodeEncodeError:
        raise ValueError(f"structured_output.{kind} is not valid Unicode (a lone surrogate)"
                         ) from None
    if size > MAX_SPEC_BYTES:
        raise ValueError(f"structured_output.{kind} is {size} bytes; the limit is "
                         f"{MAX_SPEC_BYTES} bytes")
