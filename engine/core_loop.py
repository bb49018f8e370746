"""The engine core's busy loop: take commands, step while there is work, send what happened.

The same loop runs in a thread (tests, `--no-engine-core-process`) and as the main loop of the
core's own process; only the transport differs. It blocks on the transport only when the core
has nothing to compute, so an idle engine burns no CPU, and otherwise steps back to back,
picking up commands between steps without waiting for them.

Command errors go back to their caller and are never fatal. A step that raises fails every
request in flight (`Failed`) and aborts them, so nothing waits for an output that will never
come; the loop itself goes on.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Protocol

import torch

from pdmesh.engine.core import EngineCore, KVCacheFullError
from pdmesh.engine.core_protocol import (
    Abort,
    AddImported,
    AddRequest,
    AddResumed,
    Batch,
    Call,
    Failed,
    KVSnapshot,
    ReadKV,
    ReleaseKV,
    Reply,
    Result,
    SetGrammarVocabulary,
    Shutdown,
    StopSequences,
    events_to_wire,
)

logger = logging.getLogger(__name__)


class CoreTransport(Protocol):
    def receive(self, block: bool) -> list[tuple[Call, torch.Tensor | None]]:
        """Commands waiting (blocking for the first one when `block`)."""

    def send(self, reply: Reply, tensor: torch.Tensor | None = None) -> None: ...


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
    if isinstance(cmd, AddRequest):
        core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                         priority=cmd.priority, cache_salt=cmd.cache_salt,
                         export_kv=cmd.export_kv)
    elif isinstance(cmd, AddImported):
        if tensor is None:
            raise ValueError("kv: an imported request needs its KV tensor")
        core.add_imported_request(cmd.request_id, cmd.prompt_token_ids, cmd.first_token_ids,
                                  tensor, cmd.params, priority=cmd.priority,
                                  cache_salt=cmd.cache_salt,
                                  num_cached_tokens=cmd.num_cached_tokens)
    elif isinstance(cmd, AddResumed):
        core.add_resumed_request(cmd.request_id, cmd.prompt_token_ids, cmd.output_token_ids,
                                 cmd.params, priority=cmd.priority, cache_salt=cmd.cache_salt)
    elif isinstance(cmd, Abort):
        return core.abort_request(cmd.request_id)
    elif isinstance(cmd, StopSequences):
        core.stop_sequences(cmd.request_id, cmd.indices)
    elif isinstance(cmd, ReadKV):
        return core.read_kv(cmd.request_id)
    elif isinstance(cmd, ReleaseKV):
        return core.release_kv(cmd.request_id)
    elif isinstance(cmd, KVSnapshot):
        return core.kv_snapshot()
    elif isinstance(cmd, SetGrammarVocabulary):
        core.set_grammar_vocabulary(cmd.vocabulary)
    else:
        raise ValueError(f"unknown command {type(cmd).__name__}")
    return None


class CoreLoop:
    def __init__(self, core: EngineCore, transport: CoreTransport) -> None:
        self.core = core
        self.transport = transport

    def run(self) -> None:
        """Until a `Shutdown` command; every request still in the core is aborted then."""
        idle = True
        while True:
            unanswered = False
            for call, tensor in self.transport.receive(block=idle):
                if isinstance(call.command, Shutdown):
                    self._shutdown()
                    self._reply(call, None, None)
                    return
                self._execute(call, tensor)
                unanswered |= call.call_id == 0
            if unanswered:  # fire-and-forget commands (aborts, releases) change the load too
                self.transport.send(Batch([], self.core.load()))
            idle = not self._step()

    def _execute(self, call: Call, tensor: torch.Tensor | None) -> None:
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
        result = Result(call.call_id, self.core.load())
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
        try:
            outputs = core.step()
        except Exception as exc:
            logger.exception("engine step failed; failing every request in flight")
            self._fail_all(exc)
            return False
        events = core.take_kv_events()
        if outputs or events or core.num_steps != steps_before:
            self.transport.send(Batch(outputs, core.load(), events_to_wire(events)))
        # No step ran and nothing came out: waiting requests are blocked (e.g. on pinned KV).
        # Block on the commands until something (a release, an abort) changes that.
        return core.num_steps != steps_before or bool(outputs)

    def _fail_all(self, exc: BaseException) -> None:
        self.core.drop_in_flight()
        ids = list(self.core.requests)
        for request_id in ids:
            with contextlib.suppress(Exception):
                self.core.abort_request(request_id)
        events = self.core.take_kv_events()
        self.transport.send(Failed(ids, f"engine step failed: {type(exc).__name__}: {exc}",
                                   self.core.load()))
        if events:
            self.transport.send(Batch([], self.core.load(), events_to_wire(events)))

    def _shutdown(self) -> None:
        for request_id in list(self.core.requests):
            with contextlib.suppress(Exception):
                self.core.abort_request(request_id)
        events = self.core.take_kv_events()
        self.transport.send(Batch([], self.core.load(), events_to_wire(events)))
