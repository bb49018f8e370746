"""A child process of `pdmesh serve`, and what it printed when it became ready.

Every child prints one `ready <host:port> key=value ...` line when it serves; `Child` waits
for that line (with a deadline) instead of sleeping. Its stdout and stderr are read by threads
so it can never block on a pipe; its stderr (its quiet logs) goes where ours goes, and its last
lines are kept to say why it failed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from pdmesh.serve.supervisor import exit_reason

logger = logging.getLogger(__name__)


class ChildFailed(RuntimeError):
    """A child exited or stayed silent before printing its ready line; `last_words` are the
    last lines it wrote to stderr (its fatal error, if it said one)."""

    def __init__(self, message: str, last_words: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.last_words = list(last_words)


STDERR_TAIL_LINES = 12
"""How many of a child's last stderr lines are kept to show why it failed."""



class Child:
    """One service process; threads read its stdout and stderr so it can never block on a
    pipe. Its stderr (its quiet logs) goes where ours goes, line by line; the last lines are
    kept (`stderr_tail`) to say why it failed."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None):
        self.name = name
        self.argv = list(argv)
        child_env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env=child_env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.address: str | None = None
        self.ready_line = ""
        self.fields: dict[str, str] = {}  # the ready line's key=value fields
        self.lines: list[str] = []  # what it printed up to and including the ready line
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        threading.Thread(target=self._pump, name=f"stdout-{name}", daemon=True).start()
        self._relay = threading.Thread(target=self._relay_stderr, name=f"stderr-{name}",
                                       daemon=True)
        self._relay.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _relay_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_tail.append(line.rstrip("\n"))
            with contextlib.suppress(OSError, ValueError):  # our stderr closed: keep draining
                sys.stderr.write(line)
                sys.stderr.flush()

    def last_words(self, wait_s: float = 2.0) -> list[str]:
        """Its last stderr lines; after it exited, once they have all been read."""
        if self.proc.poll() is not None:
            self._relay.join(wait_s)
        return list(self.stderr_tail)

    def wait_ready(self, timeout_s: float) -> str:
        """Block until the child prints `ready <address> ...`; returns the address."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChildFailed(f"{self.name} printed no ready line within {timeout_s:g}s",
                                  self.last_words())
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                code = self.proc.wait()
                raise ChildFailed(f"{self.name} ended ({exit_reason(code)}) before it was ready",
                                  self.last_words())
            logger.debug("%s: %s", self.name, line)
            self.lines.append(line)
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "ready":
                self.address, self.ready_line = parts[1], line
                self.fields = dict(p.split("=", 1) for p in parts[2:] if "=" in p)
                return self.address

    @property
    def metrics_url(self) -> str:
        """The child's /metrics URL ("" when it serves none)."""
        return self.fields.get("metrics", "")

    def running(self) -> bool:
        return self.proc.poll() is None

    def poll(self) -> int | None:
        """Its exit status once it has exited, else None."""
        return self.proc.poll()

    def terminate(self, grace_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after `grace_s`; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s ignored SIGTERM for %gs; killing it", self.name, grace_s)
            self.proc.kill()
            return self.proc.wait(timeout=grace_s)

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(timeout=30)


def pdmesh_command(component: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "pdmesh.cli", component, *args]


@dataclass(frozen=True)
class Endpoint:
    """Where a child served when it first became ready. A restart serves there again, so that
    whoever knows the address (router, gateway, clients, scrapers) needs no new one."""

    address: str  # host:port of its gRPC or HTTP server
    metrics_port: int = 0  # 0: none of its own (the gateway serves /metrics on its API port)

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @classmethod
    def of(cls, child: Child) -> Endpoint:
        assert child.address is not None, f"{child.name} is not ready"
        metrics = urlsplit(child.metrics_url).port if child.metrics_url else None
        return cls(child.address, metrics or 0)

