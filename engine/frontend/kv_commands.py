"""The KV-moving half of `AsyncEngine`'s API: exports, their leases, and streamed pulls.

The prefill role runs a prompt to its first token(s) with its KV kept pinned
(`prefill_export`), streamed as the prefill fills each block when asked (the progress goes to a
watcher on the loop), then reads it out (`read_kv`) or lends it to the core's KV connector
(`export_kv`) until `release_kv`. The decode role feeds a streamed pull what the prefill side
reports: the export's progress (`kv_stream`) and, when its prefill ends, the first tokens
(`kv_stream_first_tokens`). Mixed into `AsyncEngine` (engine/frontend/async_engine.py), whose
commands (`calls`), streams and request entry (`add`) these use, so every layer keeps calling
them on the engine itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from pdmesh.engine.core_protocol import (
    ExportKV,
    KVStream,
    KVStreamFirstTokens,
    LendPrefix,
    ReadKV,
    ReleaseKV,
    StopSequences,
)
from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.frontend.core_calls import CoreCalls, EngineError
from pdmesh.engine.frontend.output_processor import OutputProcessor
from pdmesh.engine.frontend.request_streams import RequestStreams
from pdmesh.engine.outputs import RequestOutput, TokenLogprobs
from pdmesh.engine.tokenizing import check_given_logprobs, tokenize_prompt
from pdmesh.kvstore.connector.export_info import ExportInfo, ExportProgress, PrefixLoan
from pdmesh.kvstore.connector.source import KVSource

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    import torch

    from pdmesh.engine.sampling_params import SamplingParams


class KVCommands:
    """`AsyncEngine`'s KV commands; the engine provides what is declared here."""

    tokenizer: Any
    calls: CoreCalls
    streams: RequestStreams
    processor: OutputProcessor

    if TYPE_CHECKING:
        def add(self, request: EngineRequest, *, prompt_text: str | None = None,
                given_logprobs: list[list[TokenLogprobs | None]] | None = None,
                added: asyncio.Event | None = None) -> AsyncIterator[RequestOutput]: ...

    async def prefill_export(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        on_kv_progress: Callable[[ExportProgress], None] | None = None,
        prefix_source: KVSource | None = None,
    ) -> RequestOutput:
        """Prefill role: run the prompt, sample the first token(s), keep the KV pinned.

        The result has `kv_export` set; the caller must eventually `release_kv` (or `abort`).
        Cancelling the awaiting task aborts the request. With `on_kv_progress` the export is
        streamed: the core lends each block as the prefill fills it and the callback gets
        every `ExportProgress` (on the loop), the last one `sealed` (the export is then lent:
        `export_kv` answers its checksums) or `failed`. With `prefix_source` the prompt's
        leading blocks are pulled from the peer that lends them first (the result's
        `kv_load` says how that went).
        """
        text, ids = tokenize_prompt(self.tokenizer, prompt)
        request = EngineRequest(request_id, ids, params, priority, cache_salt, export_kv=True,
                                stream_kv=on_kv_progress is not None,
                                prefix_source=prefix_source)
        last: RequestOutput | None = None
        if on_kv_progress is not None:
            self.streams.watch_export(request_id, on_kv_progress)
        try:
            async for out in self.add(request, prompt_text=text):
                last = out
        finally:
            self.streams.watch_export(request_id, None)
        if last is None or last.kv_export is None:
            raise EngineError(f"request {request_id!r} finished without exported KV")
        return last

    async def read_kv(self, request_id: str) -> torch.Tensor:
        """A copy of an exported request's KV blocks."""
        return await self.calls.call(ReadKV(request_id))  # type: ignore[no-any-return]

    async def export_kv(self, request_id: str) -> ExportInfo:
        """Lend an exported request's blocks to the core's KV connector (peers pull them
        straight from its cache until `release_kv`); their per-block checksums."""
        value = await self.calls.call(ExportKV(request_id))
        return value if isinstance(value, ExportInfo) else msgspec.convert(value, ExportInfo)

    async def kv_stream(self, request_id: str, progress: ExportProgress) -> bool:
        """A streamed source of `request_id` grew; False if it no longer waits for it."""
        return bool(await self.calls.call(KVStream(request_id, progress)))

    async def kv_stream_first_tokens(
            self, request_id: str, given_tokens: list[list[int]],
            given_logprobs: list[list[TokenLogprobs | None]] | None = None) -> bool:
        """A streamed request's first tokens: it decodes once its KV has landed. Its outputs
        carry them from here on, as an imported request's carry its given tokens."""
        if given_logprobs is not None:
            check_given_logprobs(given_tokens, given_logprobs, len(given_tokens))
        stopped = self.processor.give(request_id, given_tokens, given_logprobs)
        taken = bool(await self.calls.call(KVStreamFirstTokens(request_id, given_tokens)))
        if taken and stopped:
            self.calls.send(StopSequences(request_id, stopped))
        return taken

    async def release_kv(self, request_id: str) -> bool:
        return bool(await self.calls.call(ReleaseKV(request_id)))

    async def lend_prefix(self, lend_id: str, token_ids: list[int], cache_salt: str | None,
                          *, min_blocks: int = 1, max_blocks: int = 0) -> PrefixLoan:
        """Lend the leading blocks of `token_ids` the core's prefix cache holds to its KV
        connector, pinned until `release_kv(lend_id)` (a peer pulls them instead of
        recomputing); no blocks when it holds fewer than `min_blocks`. Cancelled while the
        core answers (the caller's call went away): the loan, which nobody would publish or
        release, is released behind the command that made it."""
        try:
            value = await self.calls.call(LendPrefix(lend_id, list(token_ids), cache_salt,
                                                     min_blocks, max_blocks))
        except asyncio.CancelledError:
            if not self.calls.closed:
                self.release_kv_nowait(lend_id)
            raise
        return value if isinstance(value, PrefixLoan) else msgspec.convert(value, PrefixLoan)

    def release_kv_nowait(self, request_id: str) -> None:
        """Thread-safe (transfer leases end on other threads)."""
        self.calls.send(ReleaseKV(request_id))
