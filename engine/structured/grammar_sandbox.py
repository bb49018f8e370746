"""Grammar compiles where they can be stopped: a pool of worker processes that try a spec
against the vocabulary under a time budget.

xgrammar compiles in native code that no thread can interrupt, and a spec's cost is not
visible from its size: a JSON schema of 1,000 optional properties (28 KB) takes ~3 s against a
49k-token vocabulary, 5,000 of them minutes and gigabytes. So a spec is first *tried* in a
sandbox process; one that does not finish within the budget has its process killed (the CPU
and memory come back at once) and is refused, and only a spec proven to compile within the
budget is compiled where it is needed (the engine core, which cannot take a compiled grammar
from another process cheaply: serialized, a 1,000-property schema is 220 MB). The router uses
the same sandbox to refuse such specs before any engine sees them.

Each probe takes an idle worker, and a new one is started when all are busy (up to
`max_workers`), so a slow spec holds one worker for at most the budget and never queues a
small one behind it. Workers beyond the first retire after `IDLE_RETIRE_S` unused.

The wire between the two processes is length-prefixed msgpack (msgspec), never pickle. The
worker runs `python -m pdmesh.engine.structured.grammar_sandbox` and exits when its parent goes
away.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

import msgspec

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0
"""A worker imports xgrammar (and torch under it) and builds the vocabulary: seconds, and more
on a loaded host; this bound is for a worker that will never answer."""

IDLE_RETIRE_S = 60.0
"""Workers beyond the first exit after this long unused (each holds ~300 MB)."""

WORKER_NICE = 10
"""Probes yield the CPU to the engine's steps, as the engine's own compile thread does."""

_FRAME = struct.Struct("<I")


class Init(msgspec.Struct, tag=True):
    """The vocabulary: xgrammar's serialized TokenizerInfo (an engine core has no tokenizer), or
    a tokenizer directory and the model's vocabulary size (the router)."""

    serialized: str = ""
    tokenizer_dir: str = ""
    vocab_size: int = 0


class Probe(msgspec.Struct, tag=True):
    kind: str
    value: str | list[str] | bool


class Verdict(msgspec.Struct):
    """`error` is empty when the spec compiled; otherwise the user-facing reason."""

    error: str = ""
    seconds: float = 0.0


_Message = Init | Probe


@dataclass(frozen=True)
class SandboxVocabulary:
    serialized: str = ""
    tokenizer_dir: str = ""
    vocab_size: int = 0

    def message(self) -> Init:
        return Init(self.serialized, self.tokenizer_dir, self.vocab_size)


class GrammarSandboxError(RuntimeError):
    """The sandbox itself failed (a worker would not start): not the request's fault."""


def _write(stream: IO[bytes], payload: bytes) -> None:
    stream.write(_FRAME.pack(len(payload)) + payload)
    stream.flush()


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes | None:
    """`size` bytes from `fd`; None when the deadline passed first. EOFError when it closed."""
    chunks: list[bytes] = []
    while size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
        chunk = os.read(fd, size)
        if not chunk:
            raise EOFError("the grammar worker closed its output")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


class _Worker:
    """One sandbox process; used by one probe at a time."""

    def __init__(self, vocabulary: SandboxVocabulary) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdmesh.engine.structured.grammar_sandbox"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self.last_used = time.monotonic()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        _write(self.proc.stdin, msgspec.msgpack.encode(vocabulary.message()))
        ready = self._answer(time.monotonic() + WORKER_START_TIMEOUT_S)
        if ready is None or ready.error:
            self.kill()
            reason = "did not start in time" if ready is None else ready.error
            raise GrammarSandboxError(f"grammar sandbox: a worker {reason}")

    def probe(self, kind: str, value: Any, timeout_s: float) -> Verdict | None:
        """The verdict, or None when the budget passed (the worker is then killed)."""
        assert self.proc.stdin is not None
        payload = list(value) if isinstance(value, tuple) else value
        try:
            _write(self.proc.stdin, msgspec.msgpack.encode(Probe(kind, payload)))
            verdict = self._answer(time.monotonic() + timeout_s)
        except (EOFError, OSError):  # it died compiling: a native crash on this spec
            self.kill()
            return Verdict(f"structured_output.{kind} does not compile: the compiler crashed "
                           f"on it")
        if verdict is None:
            self.kill()
        self.last_used = time.monotonic()
        return verdict

    def _answer(self, deadline: float) -> Verdict | None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        head = _read_exact(fd, _FRAME.size, deadline)
        if head is None:
            return None
        body = _read_exact(fd, _FRAME.unpack(head)[0], deadline + 5.0)
        return None if body is None else msgspec.msgpack.decode(body, type=Verdict)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()  # type: ignore[union-attr]


class GrammarSandbox:
    """Thread-safe: `check` may run on several threads at once, each on its own worker."""

    def __init__(self, vocabulary: SandboxVocabulary, timeout_s: float,
                 max_workers: int = 4) -> None:
        self.vocabulary = vocabulary
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self._idle: list[_Worker] = []
        self._busy = 0
        self._closed = False
        self._cond = threading.Condition()

    def check(self, kind: str, value: Any) -> None:
        """Return when the spec compiles within the budget; ValueError (the request's fault)
        when it does not compile or is too slow; GrammarSandboxError when no worker starts."""
        worker = self._take()
        verdict: Verdict | None = None
        try:
            verdict = worker.probe(kind, value, self.timeout_s)
        finally:
            self._give_back(worker)
        if verdict is None:
            logger.warning("structured output: a %s spec did not compile within %.3g s; its "
                           "worker was killed", kind, self.timeout_s)
            raise ValueError(f"structured_output.{kind} did not compile within the "
                             f"{self.timeout_s:g} s budget (--structured-output-compile-"
                             f"timeout-s); simplify it (fewer optional properties, "
                             f"alternatives or repetitions)")
        if verdict.error:
            raise ValueError(verdict.error)

    def warm(self) -> None:
        """Start one worker now, so the first structured request does not wait for it."""
        self._give_back(self._take())

    def _take(self) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise GrammarSandboxError("grammar sandbox: closed")
                self._retire_idle()
                if self._idle:
                    self._busy += 1
                    return self._idle.pop()
                if self._busy < self.max_workers:
                    self._busy += 1
                    break
                self._cond.wait()
        try:
            return _Worker(self.vocabulary)  # outside the lock: it takes seconds
        except BaseException:
            with self._cond:
                self._busy -= 1
                self._cond.notify()
            raise

    def _give_back(self, worker: _Worker) -> None:
        with self._cond:
            self._busy -= 1
            if worker.alive and not self._closed:
                self._idle.append(worker)
            else:
                worker.kill()
            self._cond.notify()

    def _retire_idle(self) -> None:
        now = time.monotonic()
        keep = [w for w in self._idle if w.alive]
        old = [w for w in keep[:-1] if now - w.last_used > IDLE_RETIRE_S] if keep else []
        for w in old:
            w.kill()
        self._idle = [w for w in keep if w not in old]

    def close(self) -> None:
        """Kill the idle workers now and the busy ones when their probe ends."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for w in idle:
            w.kill()


# --- the worker process ---------------------------------------------------------------------

def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def _build_info(init: Init) -> Any:
    import xgrammar as xgr

    if init.serialized:
        return xgr.TokenizerInfo.deserialize_json(init.serialized)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(init.tokenizer_dir)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=init.vocab_size or None)


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> int:
    import xgrammar as xgr

    from pdmesh.engine.structured.grammar_build import build_grammar

    fd = stdin.fileno()
    decoder = msgspec.msgpack.Decoder(_Message)
    try:
        head = _read_exact(fd, _FRAME.size, None)
        init = decoder.decode(_read_exact(fd, _FRAME.unpack(head)[0], None))  # type: ignore[arg-type]
        compiler = xgr.GrammarCompiler(_build_info(init), max_threads=1, cache_enabled=False)
    except EOFError:
        return 0
    except Exception as exc:  # a bad vocabulary: say why, once
        _write(stdout, msgspec.msgpack.encode(Verdict(f"cannot load the vocabulary: {exc}")))
        return 1
    _write(stdout, msgspec.msgpack.encode(Verdict()))
    while True:
        try:
            head = _read_exact(fd, _FRAME.size, None)
            probe = decoder.decode(_read_exact(fd, _FRAME.unpack(head)[0], None))  # type: ignore[arg-type]
        except EOFError:
            return 0
        start = time.monotonic()
        error = ""
        try:
            value = tuple(probe.value) if isinstance(probe.value, list) else probe.value
            compiler.compile_grammar(build_grammar((probe.kind, value)))
        except ValueError as exc:
            error = str(exc)
        _write(stdout, msgspec.msgpack.encode(Verdict(error, time.monotonic() - start)))


def main() -> int:
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    with contextlib.suppress(AttributeError, OSError):
        os.nice(WORKER_NICE)
    # Frames go to the parent on the original stdout alone; anything a library prints lands on
    # stderr instead of corrupting them.
    frames = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    return _serve(sys.stdin.buffer, frames)


if __name__ == "__main__":
    sys.exit(main())
