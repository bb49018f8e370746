"""`AsyncEngine`: the services' one asyncio view of an engine, wherever its core runs.

The core (scheduler, KV cache, model) steps on its own — in a process of its own when serving
(`AsyncEngine.spawn`), or on a thread (`AsyncEngine(llm_engine)`) — and reports token deltas.
The output processor (text, stop strings, logprobs) runs here on the event loop, so every
`RequestOutput` a stream yields is built and read on one thread. Two parts it composes: the
commands to the core and their answers (engine/frontend/core_calls.py) and the requests' streams
with
the output processor behind them (engine/frontend/request_streams.py); this class is the API over
them
and the order of one request's life (open its stream, add it, yield, abort if left). Its KV
commands (the prefill role's exports and their leases, the decode role's streamed pulls) are
engine/frontend/kv_commands.py's `KVCommands`, which it mixes in.

Lifetimes are tied to consumers: a stream whose consumer stops iterating (client cancelled)
aborts its request so its blocks are freed. If a step fails, every request in flight fails
with `EngineError`; if the core itself dies, every stream and call fails at once, the engine
is marked dead (`dead_reason`, `dead_event`) and nothing waits for an output that will never
come.

A core that lives but stops answering (a stopped process, a wedged device) is told apart from a
busy one by time: `liveness` (engine/frontend/core_liveness.py) says how long it has not answered
while
work was in flight and how long its steps take, and `probe` asks a silent core for a sign of
life (answered between two steps); the service's watchdog reads them.

A service whose core runs in its own process imports no torch: the in-process core's modules
(`ThreadCoreLink`, the grammar compiler) are imported only where they are used.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pdmesh.engine.core_protocol import (
    Abort,
    Add,
    Batch,
    Call,
    Failed,
    KVSnapshot,
    ReleaseKV,
    Reply,
    Result,
    Shutdown,
    StopSequences,
)
from pdmesh.engine.core_types import CoreInfo, EngineLoadSnapshot
from pdmesh.engine.engine_request import EngineRequest, check_kv_capacity
from pdmesh.engine.frontend.core_calls import CoreCalls, EngineError
from pdmesh.engine.frontend.core_client import ProcessCoreLink
from pdmesh.engine.frontend.core_liveness import CoreLiveness
from pdmesh.engine.frontend.grammar_vocabulary import GrammarVocabularyOnce
from pdmesh.engine.frontend.kv_commands import KVCommands
from pdmesh.engine.frontend.output_processor import OutputProcessor
from pdmesh.engine.frontend.request_streams import RequestStreams
from pdmesh.engine.model_store import model_dir_for
from pdmesh.engine.outputs import RequestOutput, TokenLogprobs
from pdmesh.engine.tokenizing import (
    check_given_logprobs,
    eos_token_ids,
    load_tokenizer,
    tokenize_prompt,
)

if TYPE_CHECKING:
    import torch

    from pdmesh.engine.config import EngineConfig
    from pdmesh.engine.frontend.llm_engine import LLMEngine
    from pdmesh.engine.kv_events import KVEvent
    from pdmesh.engine.sampling_params import SamplingParams
    from pdmesh.kvstore.connector.config import KVConnectorConfig

__all__ = ["AsyncEngine", "EngineError", "EngineLoadSnapshot"]

logger = logging.getLogger(__name__)


PROBE_REQUEST_ID = "\x00pdmesh-liveness-probe"
"""A request id no request has: `probe` releases its (absent) KV, which the core answers
between two steps without touching anything."""


class AsyncEngine(KVCommands):
    """Create inside a running event loop: `AsyncEngine(llm_engine)` drives an in-process
    engine's core on a thread; `await AsyncEngine.spawn(config)` starts the core's process.
    Its KV commands (`prefill_export`, `export_kv`, `kv_stream`, ...) are `KVCommands`'."""

    def __init__(self, engine: LLMEngine | None = None, *, name: str = "engine",
                 _link: Any = None, _tokenizer: Any = None,
                 _eos: set[int] | None = None, _stream_interval: int = 1) -> None:
        self.engine = engine  # the in-process engine, when there is one (tests, offline)
        if engine is not None:
            _tokenizer, _eos = engine.tokenizer, engine.eos_token_ids
            _stream_interval = engine.config.stream_interval
        assert _tokenizer is not None and _eos is not None
        self.tokenizer = _tokenizer
        self.eos_token_ids = set(_eos)
        self.dead_event = asyncio.Event()
        self._shut_down = False
        self._core_gone = False
        self.liveness = CoreLiveness(lambda: len(self.streams) + len(self.calls))
        self.streams = RequestStreams(OutputProcessor(_tokenizer, _eos, _stream_interval),
                                      self.liveness)
        self.processor = self.streams.processor
        self.kv_events_ready = self.streams.kv_events_ready
        if engine is not None:
            from pdmesh.engine.frontend.core_client import ThreadCoreLink

            _link = ThreadCoreLink(engine.core, self._on_reply, self._on_dead, name=name)
            self._load = engine.core.load()
        else:
            self._load = EngineLoadSnapshot(num_total_blocks=_link.info.num_total_blocks,
                                            num_free_blocks=_link.info.num_total_blocks)
        self.calls = CoreCalls(_link, self.liveness)
        self.info: CoreInfo = _link.info
        self._grammar_vocabulary = GrammarVocabularyOnce(_tokenizer, self.info.vocab_size,
                                                         self.eos_token_ids)

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving (its core died, output handling failed); None while
        it serves."""
        return self.calls.dead_reason

    @classmethod
    async def spawn(cls, config: EngineConfig, *, name: str = "engine",
                    log_level: str = "WARNING",
                    connector: KVConnectorConfig | None = None) -> AsyncEngine:
        """The core in a process of its own; returns once its model is loaded."""
        link = ProcessCoreLink.launch()  # imports torch while the tokenizer loads here
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, config)
            eos = eos_token_ids(tokenizer, model_dir_for(config))
        except BaseException:
            await link.abandon()
            raise
        holder: list[AsyncEngine] = []

        def on_reply(reply: Reply, tensor: torch.Tensor | None) -> None:
            holder[0]._on_reply(reply, tensor)

        def on_dead(reason: str) -> None:
            holder[0]._on_dead(reason)

        await link.boot(config, eos, on_reply, on_dead, log_level=log_level,
                        connector=connector)
        engine = cls(None, name=name, _link=link, _tokenizer=tokenizer, _eos=eos,
                     _stream_interval=config.stream_interval)
        holder.append(engine)
        return engine

    # -- static facts (read-only after construction) ---------------------------------------------
    @property
    def block_size(self) -> int:
        return self.info.block_size

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def num_total_blocks(self) -> int:
        return self.info.num_total_blocks

    @property
    def core_pid(self) -> int | None:
        """The core's process id when it runs in a process of its own."""
        return getattr(self.calls.link, "pid", None)

    def load(self) -> EngineLoadSnapshot:
        return self._load

    # -- liveness (engine_svc/watchdog.py reads `liveness`) ----------------------------------------
    def step_tokens_bound(self, budget_tokens: int) -> int:
        return self.liveness.step_tokens_bound(budget_tokens, len(self.streams))

    def probe(self) -> None:
        """Ask the core for a sign of life unless a probe is already out: a core that lives
        answers it between two steps (a fire-and-forget command is answered with a Batch)."""
        if not self.calls.closed and self.liveness.take_probe():
            self.calls.link.send(Call(0, ReleaseKV(PROBE_REQUEST_ID)))

    def check_kv_capacity(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise `KVCacheFullError` for a request that can never fit this engine's KV pool.
        Reads fixed figures only: lets a service refuse before it spends anything on the
        request, such as pulling its KV."""
        check_kv_capacity(self.info, num_prompt_tokens, params)

    # -- requests --------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Colocated generation of a prompt to tokenize (`add`)."""
        text, ids = tokenize_prompt(self.tokenizer, prompt)
        async for out in self.add(EngineRequest(request_id, ids, params, priority, cache_salt),
                                  prompt_text=text):
            yield out

    async def add(
        self,
        request: EngineRequest,
        *,
        prompt_text: str | None = None,
        given_logprobs: list[list[TokenLogprobs | None]] | None = None,
        added: asyncio.Event | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The one way in: queue a request (a prompt, imported KV, tokens produced elsewhere:
        engine/engine_request.py) and yield cumulative outputs until one has `finished`.
        Outputs carry its given tokens too, with `given_logprobs` if any. `KVCacheFullError`
        and validation errors surface from the first iteration, before any output. A request
        with a `kv_source` says in `RequestOutput.kv_load` what the core's pull did. `added`
        is set once the core took the request (a streamed source's progress may follow)."""
        given, n = request.given_tokens, request.params.n
        if given is not None and len(given) != n:
            given = given_logprobs = None  # the core refuses the request
        elif given is not None and given_logprobs is not None:
            check_given_logprobs(given, given_logprobs, n)
        async for out in self._stream(request, prompt_text, given, given_logprobs, added):
            yield out

    async def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free all its blocks; False if unknown."""
        self.streams.end(request_id, EngineError(f"request {request_id!r} was aborted"))
        return bool(await self.calls.call(Abort(request_id)))

    def abort_nowait(self, request_id: str) -> None:
        """Fire-and-forget abort, usable from `finally` blocks and callbacks."""
        self.streams.end(request_id, EngineError(f"request {request_id!r} was aborted"))
        self.calls.send(Abort(request_id))

    # -- KV events -------------------------------------------------------------------------------
    async def take_kv_events(self) -> list[KVEvent]:
        """Events since the previous call (or snapshot)."""
        return self.streams.take_events()

    async def kv_snapshot(self) -> list[KVEvent]:
        """Everything cached right now as one batch; drops events it supersedes."""
        events = await self.calls.call(KVSnapshot())
        return events  # type: ignore[no-any-return]

    # -- life cycle ------------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Abort everything, stop the core. Pending streams fail with EngineError. Also
        releases what a dead core's link still holds (sockets, its directory)."""
        if self._shut_down:
            return
        self._shut_down = True
        self._fail_everything(EngineError("engine is shutting down"))
        if not self._core_gone:
            self.calls.link.send(Call(0, Shutdown()))
        self.calls.closed = True
        await self.calls.link.join(30.0)

    # -- one request's stream ----------------------------------------------------------------------
    async def _stream(
        self, request: EngineRequest, prompt: str | None, given: list[list[int]] | None,
        given_logprobs: list[list[TokenLogprobs | None]] | None,
        added: asyncio.Event | None = None,
    ) -> AsyncIterator[RequestOutput]:
        request_id, params = request.request_id, request.params
        if request_id in self.streams:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if params.structured_output is not None:
            await self._grammar_vocabulary.ensure_sent(self.calls, self.liveness)
        self.liveness.owe()
        stream = self.streams.open(request_id, request.num_prefill_tokens)
        # Tracked before the core sees it: its first outputs may arrive right behind the reply.
        stopped = self.processor.add_request(request_id, prompt, list(request.prompt_token_ids),
                                             params, export_kv=request.export_kv, given=given,
                                             given_logprobs=given_logprobs)
        try:
            await self.calls.call(Add.of(request), request.kv)
        except asyncio.CancelledError:
            # Cancelled while the core may be adding it: nobody will consume it, so drop it.
            if self.streams.is_open(request_id, stream):
                self.abort_nowait(request_id)
            raise
        except BaseException:
            if self.streams.is_open(request_id, stream):
                self.streams.drop(request_id)
            raise
        if stopped:
            self.calls.send(StopSequences(request_id, stopped))
        if added is not None:
            added.set()
        finished = False
        try:
            while True:
                out = await stream.next()  # an error raised here already ended the request
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished and self.streams.is_open(request_id, stream):
                # The consumer left early (client cancel, error): free the request's blocks.
                self.abort_nowait(request_id)

    # -- replies (on the event loop, in the order the core sent them) ------------------------------
    def _on_reply(self, reply: Reply, tensor: torch.Tensor | None) -> None:
        self.liveness.answered()
        try:
            self._handle(reply, tensor)
        except Exception as exc:  # a bug here must not leave streams waiting forever
            logger.exception("engine: handling a %s from the core failed", type(reply).__name__)
            self._stop_serving(f"engine output handling failed: {exc!r}")

    def _handle(self, reply: Reply, tensor: torch.Tensor | None) -> None:
        load = reply.load
        self.liveness.step_times.observe(load.num_steps, load.step_seconds, load.scheduled_tokens)
        if isinstance(reply, Batch):
            self._load = reply.load
            self._deliver(reply)
        elif isinstance(reply, Result):
            self._load = reply.load
            self._settle(reply, tensor)
        elif isinstance(reply, Failed):
            self._load = reply.load
            error = EngineError(reply.message)
            for request_id in reply.request_ids:
                self.streams.end(request_id, error)

    def _deliver(self, batch: Batch) -> None:
        for request_id, indices in self.streams.deliver(batch):
            self.calls.send(StopSequences(request_id, indices))

    def _settle(self, result: Result, tensor: torch.Tensor | None) -> None:
        if result.events is not None and result.error_kind is None:
            self.streams.clear_events()  # a snapshot supersedes what was not taken yet
        self.calls.settle(result, tensor)

    def _on_dead(self, reason: str) -> None:
        """The core is gone (its process exited, its thread died)."""
        self._core_gone = True
        self._stop_serving(reason)

    def _stop_serving(self, reason: str) -> None:
        """Nothing more can be served: fail everything now, refuse new work, tell the
        service (`dead_event`), which stops; `shutdown` still stops a core that lives on."""
        if self.calls.dead_reason is not None:
            return
        self.calls.dead_reason = reason
        self._fail_everything(EngineError(reason))
        self.calls.closed = True
        self.dead_event.set()

    def _fail_everything(self, error: EngineError) -> None:
        self.streams.end_all(error)
        self.calls.fail_all(error)

