"""The engine core's busy loop: take commands, step while there is work, send what happened.

The same loop runs in a thread (tests, `--no-engine-core-process`) and as the main loop of the
core's own process; only the transport differs. It blocks on the transport only when the core
has nothing to compute, so an idle engine burns no CPU, and otherwise steps back to back,
picking up commands between steps without waiting for them.

A request whose grammar is not compiled yet waits beside the loop, not in it: its add command
is answered once the grammar compiled on its own thread (`CoreGrammars.prepare`,
engine/core/grammars.py), and the loop steps the other requests meanwhile. Errors stay where
they were (the add's caller).

Command errors go back to their caller and are never fatal. A step that raises fails every
request in flight (`Failed`) and aborts them, so nothing waits for an output that will never
come; the loop itself goes on.
"""

from __future__ import annotations

import contextlib
import logging
import queue
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import torch

from pdmesh.engine.core.engine_core import EngineCore
from pdmesh.engine.core.startup import make_device_current
from pdmesh.engine.core_protocol import (
    Abort,
    Add,
    Batch,
    Call,
    ExportKV,
    Failed,
    KVSnapshot,
    KVStream,
    KVStreamFirstTokens,
    LendPrefix,
    ReadKV,
    ReleaseKV,
    Reply,
    Result,
    SetGrammarVocabulary,
    Shutdown,
    StopSequences,
    events_to_wire,
)
from pdmesh.engine.core_types import CoreOutput, EngineLoadSnapshot
from pdmesh.engine.engine_request import KVCacheFullError

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.005
"""How long an idle loop waits on a compiling grammar or a KV pull before looking at its
commands again."""


class CoreTransport(Protocol):
    def receive(self, block: bool) -> list[tuple[Call, torch.Tensor | None]]:
        """Commands waiting (blocking for the first one when `block`)."""

    def send(self, reply: Reply, tensor: torch.Tensor | None = None) -> None: ...


CommandQueue = queue.SimpleQueue[tuple[Call, "torch.Tensor | None"]]


def take_queued(commands: CommandQueue, block: bool) -> list[tuple[Call, torch.Tensor | None]]:
    """Every command queued (waiting for the first one when `block`): `receive` for a
    transport whose commands arrive on a queue (a core on a thread)."""
    calls = []
    try:
        calls.append(commands.get(block=block))
        while True:
            calls.append(commands.get_nowait())
    except queue.Empty:
        pass
    return calls


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, KVCacheFullError):
        return "kv_full"
    if isinstance(exc, ValueError):
        return "value"
    if isinstance(exc, KeyError):
        return "key"
    return "engine"


def execute(core: EngineCore, call: Call, tensor: torch.Tensor | None) -> Any:
    """Apply one command to the core; its result (a bool, a tensor, KV events or None)."""
    cmd = call.command
    if isinstance(cmd, Add):
        core.add(cmd.request(tensor))
    elif isinstance(cmd, ExportKV):
        return core.export_kv(cmd.request_id)
    elif isinstance(cmd, Abort):
        return core.abort_request(cmd.request_id)
    elif isinstance(cmd, StopSequences):
        core.stop_sequences(cmd.request_id, cmd.indices)
    elif isinstance(cmd, ReadKV):
        return core.read_kv(cmd.request_id)
    elif isinstance(cmd, ReleaseKV):
        return core.release_kv(cmd.request_id)
    elif isinstance(cmd, LendPrefix):
        return core.lend_prefix(cmd.lend_id, cmd.prompt_token_ids, cmd.cache_salt,
                                cmd.min_blocks, cmd.max_blocks)
    elif isinstance(cmd, KVStream):
        return core.kv_stream(cmd.request_id, cmd.progress)
    elif isinstance(cmd, KVStreamFirstTokens):
        return core.kv_stream_first_tokens(cmd.request_id, cmd.given_tokens)
    elif isinstance(cmd, KVSnapshot):
        return core.kv_snapshot()
    elif isinstance(cmd, SetGrammarVocabulary):
        core.grammars.set_vocabulary(cmd.vocabulary)
    else:
        raise ValueError(f"unknown command {type(cmd).__name__}")
    return None


def occupancy(core: EngineCore) -> tuple[int, int, int, int]:
    """The load figures a step can change without running the model or sending an output:
    the landing before it frees an aborted request's pulled blocks, or places a landed pull
    to wait. A change is reported even then; else the serving side (and through it the
    router) would see those blocks taken until the next command."""
    scheduler = core.scheduler
    return (core.num_free_blocks, len(core.admission.loads.loading), len(scheduler.waiting),
            len(scheduler.running))


@dataclass
class _Deferred:
    """An add command waiting for its request's grammar to compile."""

    call: Call
    tensor: torch.Tensor | None
    grammar: Future[Any]


class CoreLoop:
    def __init__(self, core: EngineCore, transport: CoreTransport) -> None:
        self.core = core
        self.transport = transport
        self._deferred: list[_Deferred] = []
        core.send_early = self._send_early

    def run(self) -> None:
        """Until a `Shutdown` command; every request still in the core is aborted then."""
        # CUDA's current device is per thread: a core stepped on a thread of its own
        # (`--no-engine-core-process`) must make its device current there too.
        make_device_current(self.core.device)
        idle = True
        while True:
            unanswered = False
            pending = [d.grammar for d in self._deferred] + self.core.loads_in_flight()
            if idle and pending:  # grammars compiling, KV pulls running: wake when one ends
                wait(pending, GRAMMAR_WAIT_S, FIRST_COMPLETED)
            for call, tensor in self.transport.receive(block=idle and not pending):
                if isinstance(call.command, Shutdown):
                    self._shutdown()
                    self._reply(call, None, None)
                    return
                self._execute(call, tensor)
                unanswered |= call.call_id == 0
            if unanswered:  # fire-and-forget commands (aborts, releases) change the load too
                self.transport.send(Batch([], self._load()))
            self._add_compiled()
            idle = not self._step()

    def _execute(self, call: Call, tensor: torch.Tensor | None) -> None:
        cmd = call.command
        if isinstance(cmd, Add):
            grammar = self.core.grammars.prepare(cmd.params)
            if grammar is not None:
                self._deferred.append(_Deferred(call, tensor, grammar))
                return
        elif isinstance(cmd, Abort) and self._drop_deferred(cmd.request_id):
            self._reply(call, True, None)
            return
        self._run(call, tensor)

    def _add_compiled(self) -> None:
        """Add, in arrival order, the deferred requests whose grammar is ready."""
        if not self._deferred:
            return
        ready = [d for d in self._deferred if d.grammar.done()]
        if ready:
            self._deferred = [d for d in self._deferred if not d.grammar.done()]
            for d in ready:
                self._run(d.call, d.tensor)

    def _drop_deferred(self, request_id: str) -> bool:
        """An abort for a request still waiting on its grammar: it never reaches the core.
        Its add is answered as done (the caller that aborted has already ended its stream)."""
        dropped = [d for d in self._deferred
                   if getattr(d.call.command, "request_id", None) == request_id]
        for d in dropped:
            self._deferred.remove(d)
            self._reply(d.call, None, None)
        return bool(dropped)

    def _load(self) -> EngineLoadSnapshot:
        """The core's load, with the adds waiting on their grammar counted as waiting."""
        load = self.core.load()
        if self._deferred:
            load = msgspec.structs.replace(load,
                                           num_waiting=load.num_waiting + len(self._deferred))
        return load

    def _run(self, call: Call, tensor: torch.Tensor | None) -> None:
        try:
            value = execute(self.core, call, tensor)
        except Exception as exc:  # handed to the caller, not fatal to the core
            if call.call_id == 0:
                logger.warning("engine command %s failed: %r", type(call.command).__name__, exc)
            self._reply(call, None, exc)
            return
        self._reply(call, value, None)

    def _reply(self, call: Call, value: Any, exc: BaseException | None) -> None:
        if call.call_id == 0:
            return
        result = Result(call.call_id, self._load())
        tensor = None
        if exc is not None:
            result.error_kind = error_kind(exc)
            result.error = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args \
                else str(exc)
        elif isinstance(value, torch.Tensor):
            tensor = value
        elif isinstance(value, list):
            result.events = events_to_wire(value)
        else:
            result.value = value
        self.transport.send(result, tensor)

    def _step(self) -> bool:
        """One step if there is work; True if it made progress (keep stepping)."""
        core = self.core
        if not core.has_unfinished_requests():
            return False
        steps_before = core.num_steps
        occupied_before = occupancy(core)
        try:
            outputs = core.step()
        except Exception as exc:
            logger.exception("engine step failed; failing every request in flight")
            self._fail_all(exc)
            return False
        events = core.take_kv_events()
        if (outputs or events or core.num_steps != steps_before
                or occupancy(core) != occupied_before):
            self.transport.send(Batch(outputs, self._load(), events_to_wire(events)))
        # No step ran and nothing came out: waiting requests are blocked (e.g. on pinned KV).
        # Block on the commands until something (a release, an abort) changes that.
        return core.num_steps != steps_before or bool(outputs)

    def _send_early(self, outputs: list[CoreOutput]) -> None:
        """Outputs the core sends before its step runs (`EngineCore.send_early`)."""
        self.transport.send(Batch(outputs, self._load()))

    def _fail_all(self, exc: BaseException) -> None:
        self.core.drop_in_flight()
        ids = list(self.core.requests)
        for request_id in ids:
            with contextlib.suppress(Exception):
                self.core.abort_request(request_id)
        events = self.core.take_kv_events()
        self.transport.send(Failed(ids, f"engine step failed: {type(exc).__name__}: {exc}",
                                   self._load()))
        if events:
            self.transport.send(Batch([], self._load(), events_to_wire(events)))

    def _shutdown(self) -> None:
        for d in self._deferred:
            self._reply(d.call, None, RuntimeError("engine is shutting down"))
        self._deferred.clear()
        for request_id in list(self.core.requests):
            with contextlib.suppress(Exception):
                self.core.abort_request(request_id)
        events = self.core.take_kv_events()
        self.transport.send(Batch([], self._load(), events_to_wire(events)))
