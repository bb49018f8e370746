"""The tokenizer's grammar vocabulary, sent to an engine core once, before its first structured
request: the core compiles grammars against the serving side's tokenizer, which it never loads
itself."""

from __future__ import annotations

import asyncio
from typing import Any

from pdmesh.engine.core_protocol import SetGrammarVocabulary
from pdmesh.engine.frontend.core_calls import CoreCalls
from pdmesh.engine.frontend.core_liveness import CoreLiveness


class GrammarVocabularyOnce:
    """Builds the vocabulary off the event loop (importing xgrammar and reading the vocabulary
    take seconds) and sends it once; concurrent first requests wait for the one sending."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> None:
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, eos_token_ids
        self._lock = asyncio.Lock()
        self._sent = False

    async def ensure_sent(self, calls: CoreCalls, liveness: CoreLiveness) -> None:
        async with self._lock:
            if self._sent:
                return
            vocabulary = await asyncio.to_thread(
                _grammar_vocabulary, self._tokenizer, self._vocab_size, self._eos)
            # The core imports xgrammar meanwhile: seconds without an answer.
            liveness.setting_up = True
            try:
                await calls.call(SetGrammarVocabulary(vocabulary))
            finally:
                liveness.setting_up = False
            self._sent = True


def _grammar_vocabulary(tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> str:
    """engine/structured/grammar.py's vocabulary, imported here (off the event loop) on first use
    only: a service that never serves a structured request never imports xgrammar."""
    from pdmesh.engine.structured.grammar import grammar_vocabulary

    return grammar_vocabulary(tokenizer, vocab_size, eos_token_ids)
