"""Restarting child processes that die: `Supervisor`, one `ChildSpec` per child.

`pdmesh serve` runs every part of a mesh as a child process. A child that dies (SIGKILL, an
OOM kill, a crash, an engine whose core died) has to come back, or the mesh degrades for good.
Each supervised child gets a watcher thread that polls its process (which also reaps it: a
dead child never lingers as a zombie), logs why it ended (exit code or signal) and how long it
ran, runs the spec's clean-up, waits out the backoff, launches it again and waits until it
serves. The rest of the mesh keeps serving meanwhile: no restart waits for another.

The backoff is exponential and capped, and starts over once a run lasted `healthy_after_s`:
a child that crashes while starting is retried ever more slowly instead of in a loop, one that
dies after a long healthy run comes back at once.

Nothing here knows about the mesh: the spec says how to launch a child and what to do when one
is launched or has ended (`serve/mesh.py` keeps its view of the mesh current that way).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger(__name__)


class Supervised(Protocol):
    """What the supervisor needs of a child process."""

    @property
    def pid(self) -> int | None: ...

    def poll(self) -> int | None:
        """The exit status once it has exited (reaping it), else None."""
        ...

    def wait_ready(self, timeout_s: float) -> object:
        """Block until it serves; raise if it exits or stays silent first."""
        ...

    def kill(self) -> int:
        """SIGKILL it (if still running) and return its exit status."""
        ...


@dataclass(frozen=True)
class Backoff:
    """Waits before restarts: `initial_s`, times `factor` per failure in a row, at most
    `max_s`; a run of `healthy_after_s` or longer resets the count."""

    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0
    healthy_after_s: float = 60.0

    def delay_s(self, failures: int) -> float:
        """The wait before the next start after `failures` failures in a row (0 = none)."""
        return min(self.max_s, self.initial_s * self.factor ** min(failures, 64))


@dataclass
class ChildSpec:
    """How to (re)start one child, and the owner's hooks around its life."""

    name: str
    launch: Callable[[], Supervised]  # starts the process; does not wait for it to serve
    startup_timeout_s: float = 180.0
    backoff: Backoff = field(default_factory=Backoff)
    # The new process, called before it serves: its owner can stop it from then on.
    on_launch: Callable[[Supervised], None] | None = None
    # A process that ended (or never became ready) and its exit status: clean up after it.
    on_exit: Callable[[Supervised, int], None] | None = None


@dataclass
class ChildState:
    """One supervised child as it is now."""

    spec: ChildSpec
    process: Supervised
    started_at: float  # time.monotonic() of the current process's launch
    failures: int = 0  # short runs and failed starts in a row
    restarts: int = 0
    exits: int = 0  # processes that ended (or never became ready) while supervised
    last_exit: str = ""  # why the last of them ended, "" until one did
    ended: Supervised | None = None  # the last of them, for its owner to read its last words


def exit_reason(status: int) -> str:
    """`Popen.returncode` in words: a negative status is the signal that killed it."""
    if status >= 0:
        return f"exit code {status}"
    try:
        return f"killed by {signal.Signals(-status).name}"
    except ValueError:
        return f"killed by signal {-status}"


class Supervisor:
    """Watches children (`watch`) and restarts the ones that die, until `stop()`."""

    def __init__(self, poll_interval_s: float = 0.2) -> None:
        self._poll_interval_s = poll_interval_s
        self._stopping = threading.Event()
        self._launching = threading.Lock()  # held while a process is launched and handed over
        self._states: dict[str, ChildState] = {}
        self._threads: list[threading.Thread] = []

    def watch(self, spec: ChildSpec, process: Supervised) -> None:
        """Supervise `process` (started and serving) as `spec.name`."""
        state = ChildState(spec, process, started_at=time.monotonic())
        self._states[spec.name] = state
        thread = threading.Thread(target=self._supervise, args=(state,),
                                  name=f"supervise-{spec.name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def state(self, name: str) -> ChildState:
        return self._states[name]

    def states(self) -> list[ChildState]:
        return list(self._states.values())

    def stop(self) -> None:
        """No more restarts. Returns once no launch is under way, so every process launched
        has been handed to its owner (`on_launch`), who stops it."""
        self._stopping.set()
        with self._launching:
            pass

    def join(self, timeout_s: float = 10.0) -> None:
        """After `stop()` and the children's end: wait for the watcher threads."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- one watcher thread per child ------------------------------------------------------------
    def _supervise(self, state: ChildState) -> None:
        while True:
            status = self._wait_for_exit(state.process)
            if status is None:
                return  # stopping: the owner ends the children
            ran_s = time.monotonic() - state.started_at
            if ran_s >= state.spec.backoff.healthy_after_s:
                state.failures = 0
            delay_s = state.spec.backoff.delay_s(state.failures)
            state.failures += 1
            logger.warning("child exited name=%s pid=%s reason=%r ran_s=%.1f restart_in_s=%.1f",
                           state.spec.name, state.process.pid, exit_reason(status), ran_s,
                           delay_s)
            self._ended(state, state.process, status)
            if not self._restart(state, delay_s):
                return

    def _wait_for_exit(self, process: Supervised) -> int | None:
        """The process's exit status, or None once stopping."""
        while (status := process.poll()) is None:
            if self._stopping.wait(self._poll_interval_s):
                return None
        return None if self._stopping.is_set() else status

    def _restart(self, state: ChildState, delay_s: float) -> bool:
        """Launch until a process serves (True) or the supervisor stops (False)."""
        spec = state.spec
        while not self._stopping.wait(delay_s):
            process: Supervised | None = None
            with self._launching:
                if self._stopping.is_set():
                    return False
                try:
                    process = spec.launch()
                except Exception as exc:  # the launch itself failed (exec, a taken port)
                    error: Exception = exc
                else:
                    state.process, state.started_at = process, time.monotonic()
                    if spec.on_launch is not None:
                        spec.on_launch(process)
            if process is not None:
                try:
                    process.wait_ready(spec.startup_timeout_s)
                except Exception as exc:  # it exited or stayed silent
                    error = exc
                    self._ended(state, process, process.kill())
                else:
                    state.restarts += 1
                    logger.warning("child restarted name=%s pid=%s restarts=%d",
                                   spec.name, process.pid, state.restarts)
                    return True
            if self._stopping.is_set():
                return False
            delay_s = spec.backoff.delay_s(state.failures)
            state.failures += 1
            logger.warning("child failed to restart name=%s error=%r retry_in_s=%.1f",
                           spec.name, str(error), delay_s)
        return False

    @staticmethod
    def _ended(state: ChildState, process: Supervised, status: int) -> None:
        """Record a process that ended, then clean up after it."""
        state.exits += 1
        state.last_exit, state.ended = exit_reason(status), process
        if state.spec.on_exit is None:
            return
        try:
            state.spec.on_exit(process, status)
        except Exception:  # a clean-up must never end the supervision of the child
            logger.exception("clean-up after child failed name=%s", state.spec.name)
