"""A spec's tokenizer-free grammar (xgrammar's `Grammar`), and xgrammar's errors made readable.

Its own module because both sides of the grammar sandbox need it: the worker process tries the
spec with it, and `grammar.py`, which starts the sandbox, compiles with it. In `grammar.py` it
made the two modules import each other, and loaded torch into every sandbox worker.
xgrammar is imported lazily: it costs ~2 s to import.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from pdmesh.engine.structured_output import GRAMMAR_CACHE_SIZE

if TYPE_CHECKING:
    import xgrammar

_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")
"""xgrammar's C++ errors start with a time, a source location and the failed check."""


def error_detail(exc: Exception) -> str:
    """An xgrammar error on one line, without its C++ time, source location and check."""
    return _NATIVE_PREFIX.sub("", " ".join(str(exc).split())) or type(exc).__name__


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def build_grammar(key: tuple[str, Any]) -> xgrammar.Grammar:
    """The tokenizer-free grammar of a spec's (kind, value); ValueError names the kind."""
    import xgrammar as xgr

    kind, value = key
    try:
        if kind == "json_schema":
            # Compact JSON: free whitespace lets a small model loop on spaces until max_tokens.
            return xgr.Grammar.from_json_schema(value, any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        return xgr.Grammar.from_ebnf(value)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError/InvalidJSONError
        detail = error_detail(exc)
        raise ValueError(f"structured_output.{kind} does not compile: {detail}") from None
