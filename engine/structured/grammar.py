"""Grammars in the engine: compiling a request's `StructuredOutput` against the vocabulary,
one matcher per sequence, and masking logits with it (xgrammar).

`GrammarCompiler` (one per engine) first tries each new spec in the grammar sandbox
(`grammar_sandbox.py`: a worker process killed when the spec's budget passes), then compiles
it here, on a few low-priority threads (`prepare`), so neither a new nor a pathological spec
stalls the step loop or the grammars of other requests. The engine core has no tokenizer: its
serving side sends it the vocabulary once (`grammar_vocabulary`) before the first structured
request. The engine masks each constrained row's logits with the matcher's allowed-token
bitmask before sampling (`apply_bitmasks`) and advances the matcher with every token the
sequence records, sampled here or replayed from elsewhere (P/D first tokens, resumed
requests), so every instance walks the grammar from the same tokens.

xgrammar is imported lazily: it costs ~2 s to import and most processes never need it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from pdmesh.engine.structured.grammar_build import build_grammar, error_detail
from pdmesh.engine.structured.grammar_sandbox import GrammarSandbox, SandboxVocabulary
from pdmesh.engine.structured_output import (
    DEFAULT_COMPILE_TIMEOUT_S,
    GRAMMAR_CACHE_SIZE,
    StructuredOutput,
)

if TYPE_CHECKING:
    import xgrammar

GRAMMAR_COMPILE_NICE = 10
"""The compile threads' nice value. Where the step's threads use every core (a CPU engine), a
compile at their priority slows each step several times over (OpenMP regions wait for the
thread it displaced); at 10 the running streams barely notice and a new schema takes about
twice as long to admit (bench/grammar_stall.py). With spare cores (a GPU host) it changes
nothing."""

COMPILE_LANES = 4
"""Specs compiled at once: a spec that passed the sandbox still takes up to its budget here,
and the next request's small one should not wait for it."""


class GrammarMatcher:
    """One sequence's position in its grammar.

    With `after` (a reasoning model's end-of-thinking text, as bytes) the grammar starts only
    once the output has produced it: until then every token is allowed and only watched, its
    bytes (`token_bytes`, the vocabulary's) checked for the text, which may span tokens."""

    def __init__(self, compiled: xgrammar.CompiledGrammar, after: bytes = b"",
                 token_bytes: Sequence[bytes] = ()) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._after = after
        self._token_bytes = token_bytes
        self._tail = b""  # the output's last bytes while waiting for `after`
        self.started = not after

    def accept(self, token_id: int) -> bool:
        """Advance by one recorded token; False when the grammar does not allow it."""
        if not self.started:
            self._watch(token_id)
            return True
        return bool(self._matcher.accept_token(token_id))

    def _watch(self, token_id: int) -> None:
        piece = self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else b""
        window = self._tail + piece
        if self._after in window:
            self.started, self._tail = True, b""
        else:
            self._tail = window[-(len(self._after) - 1):] if len(self._after) > 1 else b""

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the sequence is done."""
        return self.started and bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.started:
            self._matcher.fill_next_token_bitmask(bitmask, row)
        else:
            bitmask[row].fill_(-1)  # every bit set: every token allowed


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
    """Compiles specs against one engine's vocabulary: each new one tried in the sandbox under
    `compile_timeout_s`, then compiled on a worker thread (xgrammar releases the GIL); an LRU
    keeps recent ones, by spec, as futures."""

    def __init__(self, vocabulary: str,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        import xgrammar as xgr

        try:
            info = xgr.TokenizerInfo.deserialize_json(vocabulary)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError on bad input
            detail = error_detail(exc)
            raise ValueError(f"grammar vocabulary: not a serialized xgrammar TokenizerInfo "
                             f"({detail})") from None
        self.vocab_size = int(info.vocab_size)
        self._info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=_compile_threads(),
                                             cache_enabled=False)
        self._sandbox = GrammarSandbox(SandboxVocabulary(serialized=vocabulary),
                                       compile_timeout_s, max_workers=COMPILE_LANES)
        self._cache: OrderedDict[tuple[str, Any], Future[xgrammar.CompiledGrammar]] = \
            OrderedDict()
        self._executor = ThreadPoolExecutor(COMPILE_LANES, thread_name_prefix="grammar-compile",
                                            initializer=_background_priority)
        self._executor.submit(self._sandbox.warm)

    def prepare(self, spec: StructuredOutput) -> Future[xgrammar.CompiledGrammar]:
        """The spec's compiled grammar, started on a worker thread unless cached. A spec that
        fails to compile (or to compile in time) stays cached as its failure."""
        future = self._cache.get(spec.key)
        if future is not None:
            self._cache.move_to_end(spec.key)
            return future
        future = self._executor.submit(self._compile, spec.key)
        self._cache[spec.key] = future
        if len(self._cache) > GRAMMAR_CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile(self, key: tuple[str, Any]) -> xgrammar.CompiledGrammar:
        self._sandbox.check(*key)
        return self._compiler.compile_grammar(build_grammar(key))

    def compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """Blocks until compiled; the spec's ValueError if it does not compile."""
        return self.prepare(spec).result()

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        if not spec.reasoning_end:
            return GrammarMatcher(self.compile(spec))
        return GrammarMatcher(self.compile(spec), spec.reasoning_end.encode("utf-8"),
                              self.token_bytes)

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """Each token's bytes as the output spells them (a grammar that starts after a
        reasoning model's thinking watches for its end in these)."""
        return [bytes(t) for t in self._info.decoded_vocab]

    def close(self) -> None:
        """Stop the threads and sandbox workers once compiles in progress end; queued ones are
        dropped."""
        self._sandbox.close()
        self._executor.shutdown(wait=False, cancel_futures=True)


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
