"""The router's verdict on a request's structured output, before it is admitted.

A spec that does not compile against the model's vocabulary, or not within
`--structured-output-compile-timeout-s`, is refused here with INVALID_ARGUMENT, so no engine
spends its budget on it and every engine's grammars stay free for specs that compile. The
verdict comes from the grammar sandbox (a worker process killed when the budget passes, the
same one the engines use), built from the router's own tokenizer directory; the router process
itself never imports xgrammar or torch for it. Verdicts are kept per spec (LRU), and requests
with the same spec arriving together share one probe.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

from pdmesh.engine.structured.grammar_sandbox import (
    GrammarSandbox,
    GrammarSandboxError,
    SandboxVocabulary,
)
from pdmesh.engine.structured_output import GRAMMAR_CACHE_SIZE, StructuredOutput
from pdmesh.router.admission import InvalidRequest

logger = logging.getLogger(__name__)

SANDBOX_WORKERS = 2
"""Probes at once: the router's CPUs are for tokenizing and serving streams."""


class GrammarCheck:
    def __init__(self, model_dir: Path, vocab_size: int, timeout_s: float) -> None:
        self._sandbox = GrammarSandbox(
            SandboxVocabulary(tokenizer_dir=str(model_dir), vocab_size=vocab_size),
            timeout_s, max_workers=SANDBOX_WORKERS)
        self._verdicts: OrderedDict[tuple[str, Any], str] = OrderedDict()
        self._probing: dict[tuple[str, Any], asyncio.Task[str]] = {}

    async def check(self, spec: StructuredOutput | None) -> None:
        """InvalidRequest naming the spec's field when it does not compile in time."""
        if spec is None:
            return
        error = self._verdicts.get(spec.key)
        if error is None:
            error = await self._probe(spec.key)
        else:
            self._verdicts.move_to_end(spec.key)
        if error:
            raise InvalidRequest(f"sampling.structured_output.{spec.kind}", error)

    async def _probe(self, key: tuple[str, Any]) -> str:
        """One probe per spec at a time, in a task of its own: a caller that goes away (its
        client cancelled) neither cancels the probe nor leaves the others waiting."""
        task = self._probing.get(key)
        if task is None:
            task = asyncio.ensure_future(self._run_probe(key))
            self._probing[key] = task
            task.add_done_callback(lambda _: self._probing.pop(key, None))
        return await asyncio.shield(task)

    async def _run_probe(self, key: tuple[str, Any]) -> str:
        try:
            error = await asyncio.to_thread(self._verdict, key)
        except GrammarSandboxError as exc:  # the engines still bound their own compiles
            logger.warning("structured output: no router-side check (%s)", exc)
            return ""
        self._verdicts[key] = error
        if len(self._verdicts) > GRAMMAR_CACHE_SIZE:
            self._verdicts.popitem(last=False)
        return error

    def _verdict(self, key: tuple[str, Any]) -> str:
        try:
            self._sandbox.check(*key)
        except ValueError as exc:
            return str(exc)
        return ""

    def close(self) -> None:
        self._sandbox.close()
