"""The core's grammar compiler: structured outputs' matchers, compiled off the step loop.

A core cannot compile a grammar until it knows the tokenizer's vocabulary, which its serving
side sends before the first structured request (`structured_output.grammar_vocabulary`); the
compiler is built then, checked against the model's vocabulary size, and rebuilt if another
vocabulary comes. `prepare` starts a request's compilation on the compiler's threads so the
loop adds the request only once it compiled (engine/core/core_loop.py); `matcher` is what a
sample of a structured request walks its grammar with.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.structured.grammar import GrammarCompiler, GrammarMatcher
from pdmesh.engine.structured_output import StructuredOutput


class CoreGrammars:
    def __init__(self, vocab_size: int, compile_timeout_s: float) -> None:
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.compiler: GrammarCompiler | None = None  # built on the vocabulary's arrival

    @property
    def has_vocabulary(self) -> bool:
        return self.compiler is not None

    def set_vocabulary(self, vocabulary: str) -> None:
        """The vocabulary grammars compile against (`structured_output.grammar_vocabulary`);
        ValueError when it is not the model's."""
        compiler = GrammarCompiler(vocabulary, self.compile_timeout_s)
        if compiler.vocab_size != self.vocab_size:
            compiler.close()
            raise ValueError(f"grammar vocabulary: {compiler.vocab_size} tokens, but the model "
                             f"has {self.vocab_size}")
        if self.compiler is not None:
            self.compiler.close()
        self.compiler = compiler

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        if self.compiler is None:
            raise ValueError("structured_output: this engine has no grammar vocabulary yet "
                             "(its serving side sends one before the first structured request)")
        return self.compiler.matcher(spec)

    def prepare(self, params: SamplingParams) -> Future[Any] | None:
        """Start compiling a request's grammar off the step loop; the future to wait for
        before adding it, or None when adding it now would not compile anything (no grammar,
        already compiled, or no vocabulary yet: `add` then refuses it)."""
        if params.structured_output is None or self.compiler is None:
            return None
        future = self.compiler.prepare(params.structured_output)
        return None if future.done() else future

    def close(self) -> None:
        """Stop the compiler's threads and sandbox workers."""
        if self.compiler is not None:
            self.compiler.close()
            self.compiler = None
