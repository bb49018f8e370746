"""Structured outputs: a grammar each output sequence must follow, enforced through xgrammar.

Three pieces, one concept. `StructuredOutput` is the request's spec (plain data, part of
`SamplingParams`). `validate` compiles the spec without a tokenizer, so the router can refuse a
schema or regex that cannot compile before any engine sees it. `GrammarCompiler` (one per
engine) compiles a spec against the engine's own vocabulary and hands out one
`GrammarMatcher` per sequence; it compiles on its own thread (`prepare`), so a new schema
does not stall the engine's step loop for every running sequence. The engine core has no
tokenizer: its serving side sends it the vocabulary once (`grammar_vocabulary`) before the
first structured request. The engine
masks each constrained row's logits with the matcher's allowed-token bitmask before sampling
(`apply_bitmasks`) and advances the matcher with every token the sequence records, sampled
here or replayed from elsewhere (P/D first tokens, resumed requests), so every instance walks
the grammar from the same tokens.

xgrammar is imported lazily: it costs ~2 s to import and most processes (gateway, requests
without a grammar) never need it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import xgrammar

_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")
"""xgrammar's C++ errors start with a time, a source location and the failed check."""

GRAMMAR_CACHE_SIZE = 128
"""Compiled grammars kept per engine (and tokenizer-free grammars per process), by spec."""

GRAMMAR_COMPILE_NICE = 10
"""The compile thread's nice value. Where the step's threads use every core (a CPU engine), a
compile at their priority slows each step several times over (OpenMP regions wait for the
thread it displaced); at 10 the running streams barely notice and a new schema takes about
twice as long to admit (bench/grammar_stall.py). With spare cores (a GPU host) it changes
nothing."""

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of the fields is set; names follow vLLM's StructuredOutputsParams.

    `json_schema` is a JSON schema as JSON text (a dict is accepted and serialized);
    `json_object` asks for any JSON object; `choice` lists the only allowed outputs;
    `grammar` is EBNF in xgrammar's dialect with a `root` rule.
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

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

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, Any]:
        """Hashable (kind, spec): the compile-cache key."""
        return self.kind, getattr(self, self.kind)


def validate(spec: StructuredOutput) -> None:
    """Compile `spec` without a tokenizer; ValueError names the field and the problem."""
    _grammar(spec.key)


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _grammar(key: tuple[str, Any]) -> xgrammar.Grammar:
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
        detail = _NATIVE_PREFIX.sub("", " ".join(str(exc).split())) or type(exc).__name__
        raise ValueError(f"structured_output.{kind} does not compile: {detail}") from None


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        """Advance by one recorded token; False when the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the sequence is done."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


def grammar_vocabulary(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> str:
    """The vocabulary as grammars see it (xgrammar's `TokenizerInfo`, as its own JSON), built
    where the tokenizer lives: the engine core compiles grammars from it and never loads a
    tokenizer. `vocab_size` is the model's (its logits' width), which may exceed the
    tokenizer's."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
    )
    return str(info.serialize_json())


class GrammarCompiler:
    """Compiles specs against one engine's vocabulary on a worker thread (xgrammar releases
    the GIL while it compiles); an LRU keeps recent ones, by spec, as futures."""

    def __init__(self, vocabulary: str) -> None:
        import xgrammar as xgr

        try:
            info = xgr.TokenizerInfo.deserialize_json(vocabulary)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError on bad input
            detail = _NATIVE_PREFIX.sub("", " ".join(str(exc).split())) or type(exc).__name__
            raise ValueError(f"grammar vocabulary: not a serialized xgrammar TokenizerInfo "
                             f"({detail})") from None
        self.vocab_size = int(info.vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=_compile_threads(),
                                             cache_enabled=False)
        self._cache: OrderedDict[tuple[str, Any], Future[xgrammar.CompiledGrammar]] = \
            OrderedDict()
        self._executor: ThreadPoolExecutor | None = None

    def prepare(self, spec: StructuredOutput) -> Future[xgrammar.CompiledGrammar]:
        """The spec's compiled grammar, started on the worker thread unless cached. A spec
        that fails to compile stays cached as its failure (compiling again fails again)."""
        future = self._cache.get(spec.key)
        if future is not None:
            self._cache.move_to_end(spec.key)
            return future
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile",
                                                initializer=_background_priority)
        future = self._executor.submit(self._compile, spec.key)
        self._cache[spec.key] = future
        if len(self._cache) > GRAMMAR_CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile(self, key: tuple[str, Any]) -> xgrammar.CompiledGrammar:
        return self._compiler.compile_grammar(_grammar(key))

    def compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """Blocks until compiled; the spec's ValueError if it does not compile."""
        return self.prepare(spec).result()

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        return GrammarMatcher(self.compile(spec))

    def close(self) -> None:
        """Stop the worker thread once any compile in progress ends; queued ones are dropped."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def _compile_threads() -> int:
    """Half the cores this process may use (at most 8): the rest stay with the step."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 2
    return max(1, min(8, cores // 2))


def _background_priority() -> None:
    with contextlib.suppress(AttributeError, OSError):  # Linux: each thread has its own
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), GRAMMAR_COMPILE_NICE)


def apply_bitmasks(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor:
    """Set to -inf, in each row with a matcher, every logit its grammar forbids next.

    Returns the float32 logits it masked (a new tensor when `logits` was another dtype).
    """
    import xgrammar as xgr

    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    if logits.dtype != torch.float32:
        logits = logits.float()
    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matchers[i].fill(bitmask, i)  # type: ignore[union-attr]
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    return logits
