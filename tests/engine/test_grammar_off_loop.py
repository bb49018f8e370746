"""Grammars compile beside the core's loop, not in it: while a new schema compiles, the other
requests keep stepping; the structured request's add is answered once its grammar is ready,
with the same errors as before; an abort or a shutdown in between leaves nothing behind.

Each test holds the compile on a gate (the real xgrammar compile runs once the gate opens),
so what happens meanwhile is deterministic.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core.core_loop import CommandQueue, CoreLoop, take_queued
from pdmesh.engine.core.engine_core import EngineCore
from pdmesh.engine.core_protocol import Abort, Add, Batch, Call, Reply, Result, Shutdown
from pdmesh.engine.core_types import CoreOutput, EngineLoadSnapshot
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.structured.grammar import grammar_vocabulary
from pdmesh.engine.structured_output import StructuredOutput
from pdmesh.engine.tokenizing import eos_token_ids

pytestmark = [pytest.mark.slow, pytest.mark.weights, pytest.mark.processes]

REPLY_TIMEOUT_S = 60.0
_specs = itertools.count()


class QueueTransport:
    """CoreLoop's transport over two queues: the test is the serving side."""

    def __init__(self) -> None:
        self.commands: CommandQueue = queue.SimpleQueue()
        self.replies: queue.SimpleQueue[Reply] = queue.SimpleQueue()

    def receive(self, block: bool) -> list[tuple[Call, torch.Tensor | None]]:
        return take_queued(self.commands, block)

    def send(self, reply: Reply, tensor: torch.Tensor | None = None) -> None:
        self.replies.put(reply)


class Driver:
    """Sends commands to a loop on its own thread and sorts what comes back."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.transport = QueueTransport()
        self.results: dict[int, Result] = {}
        self.outputs: dict[str, list[CoreOutput]] = {}
        self.last_load: EngineLoadSnapshot | None = None
        self._call_ids = itertools.count(1)
        self._thread = threading.Thread(target=CoreLoop(core, self.transport).run, daemon=True)
        self._thread.start()

    def send(self, command: Any) -> int:
        call_id = next(self._call_ids)
        self.transport.commands.put((Call(call_id, command), None))
        return call_id

    def _take(self) -> None:
        reply = self.transport.replies.get(timeout=REPLY_TIMEOUT_S)
        self.last_load = getattr(reply, "load", self.last_load)
        if isinstance(reply, Result):
            self.results[reply.call_id] = reply
        elif isinstance(reply, Batch):
            for out in reply.outputs:
                self.outputs.setdefault(out.request_id, []).append(out)
        else:
            raise AssertionError(f"unexpected reply {reply!r}")

    def result(self, call_id: int) -> Result:
        while call_id not in self.results:
            self._take()
        return self.results[call_id]

    def finished(self, request_id: str) -> list[int]:
        """The request's tokens (sample 0) once the core says it holds nothing more of it."""
        while not any(o.finished for o in self.outputs.get(request_id, [])):
            self._take()
        return [t for o in self.outputs[request_id] for s in o.samples for t in s.new_token_ids]

    def shutdown(self) -> Result:
        result = self.result(self.send(Shutdown()))
        self._thread.join(REPLY_TIMEOUT_S)
        assert not self._thread.is_alive()
        return result


@pytest.fixture(scope="module")
def core(model_dir, hf_tokenizer) -> Iterator[EngineCore]:
    eos = eos_token_ids(hf_tokenizer, model_dir)
    core = EngineCore(EngineConfig(model="smollm2", kv_cache_memory="16MiB"), eos)
    core.grammars.set_vocabulary(
        grammar_vocabulary(hf_tokenizer, core.model_config.vocab_size, eos))
    yield core
    core.close()


@pytest.fixture
def gate(core: EngineCore, monkeypatch) -> Iterator[threading.Event]:
    """Compiles wait for the gate; it opens at the end of the test whatever happened."""
    opened = threading.Event()
    compiler = core.grammars.compiler
    assert compiler is not None
    real = compiler._compile

    def gated(key: Any) -> Any:
        assert opened.wait(REPLY_TIMEOUT_S), "the test never opened the compile gate"
        return real(key)

    monkeypatch.setattr(compiler, "_compile", gated)
    yield opened
    opened.set()


def choice_params(*choices: str) -> SamplingParams:
    """A spec no earlier test compiled (the compiler caches by spec)."""
    tag = f"#{next(_specs)}"
    spec = StructuredOutput(choice=tuple(c + tag for c in choices))
    return SamplingParams(max_tokens=16, temperature=0.0, structured_output=spec)


def test_other_requests_step_while_a_grammar_compiles(core: EngineCore, gate, hf_tokenizer):
    prompt = hf_tokenizer.encode("The capital of France is")
    loop = Driver(core)
    plain = loop.send(Add("plain", prompt, SamplingParams(max_tokens=12, ignore_eos=True)))
    params = choice_params("Paris", "London")
    structured = loop.send(Add("json", prompt, params))
    assert loop.result(plain).error is None
    assert len(loop.finished("plain")) == 12  # all of it while the grammar was still compiling
    assert structured not in loop.results and "json" not in core.requests
    assert loop.last_load is not None and loop.last_load.num_waiting == 1  # counted as waiting

    gate.set()
    assert loop.result(structured).error is None
    text = hf_tokenizer.decode(loop.finished("json"), skip_special_tokens=True)
    assert text in params.structured_output.choice
    loop.shutdown()
    assert core.num_free_blocks == core.num_total_blocks and not core.requests


def test_abort_while_compiling_leaves_nothing(core: EngineCore, gate, hf_tokenizer):
    loop = Driver(core)
    add = loop.send(Add("gone", hf_tokenizer.encode("Hello"), choice_params("a", "b")))
    abort = loop.send(Abort("gone"))
    assert loop.result(abort).value is True
    assert loop.result(add).error is None  # answered; the aborting side ended its stream
    gate.set()
    again = loop.send(Abort("gone"))
    assert loop.result(again).value is False
    loop.shutdown()
    assert "gone" not in loop.outputs and not core.requests
    assert core.num_free_blocks == core.num_total_blocks


def test_a_grammar_that_fails_to_compile_fails_its_add(core: EngineCore, gate, monkeypatch,
                                                       hf_tokenizer):
    compiler = core.grammars.compiler
    gated = compiler._compile

    def failing(key: Any) -> Any:
        gated(key)  # waits for the gate, then compiles for real
        raise ValueError("structured_output.choice does not compile: too large")

    monkeypatch.setattr(compiler, "_compile", failing)
    loop = Driver(core)
    add = loop.send(Add("bad", hf_tokenizer.encode("Hello"), choice_params("x", "y")))
    gate.set()
    result = loop.result(add)
    assert result.error_kind == "value" and "does not compile: too large" in result.error
    loop.shutdown()
    assert not core.requests and core.num_free_blocks == core.num_total_blocks


def test_shutdown_answers_the_adds_still_compiling(core: EngineCore, gate, hf_tokenizer):
    loop = Driver(core)
    add = loop.send(Add("late", hf_tokenizer.encode("Hello"), choice_params("p", "q")))
    assert loop.shutdown().error is None
    result = loop.result(add)
    assert result.error_kind == "engine" and "shutting down" in result.error
    assert not core.requests
