"""`pdmesh serve`: a whole mesh on this machine, as real processes.

Starts a Redis for the cluster index (a real redis-server, see kvstore/redis_server.py) unless
`--redis-url` names one, then N prefill and M decode engine processes (or, with `--colocated`,
engines that do both), the router and the OpenAI REST gateway, each as
`python -m pdmesh.cli <role> ...`. Every child prints one `ready <host:port> ...` line when it
serves; we wait for that line (with a deadline) instead of sleeping, then print the router's
address. Ctrl-C / SIGTERM stop the children (SIGTERM, then SIGKILL after a grace period) in
reverse order: router first, so no new request reaches an engine that is going away.

Every child serves Prometheus metrics on a free port (`--metrics-port 0`); its URL comes back
in the ready line (`metrics=http://...`, `Child.metrics_url`) and `pdmesh serve` prints them
all. The OTEL_* variables of this process (or of `env`) reach every child unchanged, so one
`OTEL_EXPORTER_OTLP_ENDPOINT` traces the whole mesh.

KV segments that a prefill child leaves in shared memory when it dies without cleaning up
(SIGKILL) are removed when `pdmesh serve` notices the exit, on stop, and (segments of any dead
process) on start; they are owned by the pid of the child that created them.

`LocalMesh` is also the test harness: tests start, inspect and kill its children.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

from pdmesh.grpc_common import parse_config
from pdmesh.kvstore.redis_server import RedisServer
from pdmesh.kvstore.transfer.backends.shm import sweep_stale
from pdmesh.router.routing.base import POLICY_NAMES

logger = logging.getLogger(__name__)


class ChildFailed(RuntimeError):
    """A child exited or stayed silent before printing its ready line."""


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class MeshConfig:
    model: str = field(default="smollm2", metadata=_help("model alias or path"))
    num_prefill: int = field(default=1, metadata=_help("prefill processes"))
    num_decode: int = field(default=1, metadata=_help("decode processes"))
    host: str = field(default="127.0.0.1", metadata=_help("address every service binds"))
    port: int = field(default=0, metadata=_help("router port; 0 picks a free one"))
    redis_url: str | None = field(
        default=None, metadata=_help("use this Redis instead of starting one")
    )
    routing_policy: str = field(default="prefix_aware", metadata=_help("router policy"))
    local_prefill_threshold: int = field(
        default=256, metadata=_help("decode prefills locally below this many uncached tokens")
    )
    kv_cache_memory: str = field(default="512MiB", metadata=_help("KV budget per engine"))
    kv_backend: str = field(default="auto", metadata=_help("KV transfer data plane"))
    block_size: int = field(default=16, metadata=_help("tokens per KV block"))
    tls_cert: str | None = field(default=None, metadata=_help("PEM cert for every hop"))
    tls_key: str | None = field(default=None, metadata=_help("PEM private key"))
    tls_ca: str | None = field(default=None, metadata=_help("PEM CA: mutual TLS everywhere"))
    colocated: bool = field(
        default=False,
        metadata=_help("engines do prefill and decode themselves (no KV moves); "
                       "--num-decode of them, no prefill processes"),
    )
    gateway_port: int = field(
        default=8000, metadata=_help("OpenAI REST gateway port; 0 picks a free one, -1 disables")
    )
    api_key: str | None = field(default=None, metadata=_help("gateway API key (Bearer)"))
    startup_timeout_s: float = field(default=180.0, metadata=_help("per-child ready deadline"))
    log_level: str = field(default="warning", metadata=_help("children's log level"))

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("--num-decode must be >= 1 and --num-prefill >= 0")
        if self.routing_policy not in POLICY_NAMES:
            raise ValueError(f"--routing-policy must be one of {', '.join(POLICY_NAMES)}")
        if self.colocated:
            self.num_prefill = 0
        if self.gateway_port < -1:
            raise ValueError("--gateway-port must be -1 (off), 0 (free port) or a port")
        if self.startup_timeout_s <= 0:
            raise ValueError("--startup-timeout-s must be > 0")

    def tls_flags(self) -> list[str]:
        flags: list[str] = []
        for name in ("tls_cert", "tls_key", "tls_ca"):
            value = getattr(self, name)
            if value:
                flags += ["--" + name.replace("_", "-"), value]
        return flags


class Child:
    """One service process; its stdout is read by a thread so it can never block on a pipe."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None):
        self.name = name
        self.argv = list(argv)
        child_env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=None,  # inherited: the children's (quiet) logs go where ours go
            text=True,
            env=child_env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.address: str | None = None
        self.ready_line = ""
        self.fields: dict[str, str] = {}  # the ready line's key=value fields
        self.lines: list[str] = []  # what it printed up to and including the ready line
        threading.Thread(target=self._pump, name=f"stdout-{name}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_ready(self, timeout_s: float) -> str:
        """Block until the child prints `ready <address> ...`; returns the address."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChildFailed(f"{self.name} printed no ready line within {timeout_s:g}s")
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                code = self.proc.wait()
                raise ChildFailed(f"{self.name} exited with code {code} before it was ready")
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


class LocalMesh:
    """Redis + engines + router; `start()` returns the router address. A context manager."""

    def __init__(
        self, config: MeshConfig, router_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self.router_args = list(router_args)
        self.env = env  # the children's environment; None = this process's
        self.redis: RedisServer | None = None
        self.redis_url = config.redis_url or ""
        self.prefill: list[Child] = []
        self.decode: list[Child] = []
        self.router: Child | None = None
        self.gateway: Child | None = None

    @property
    def children(self) -> list[Child]:
        front = [c for c in (self.router, self.gateway) if c is not None]
        return [*self.prefill, *self.decode, *front]

    def engine_args(self, role: str) -> list[str]:
        c = self.config
        return [
            "--model", c.model, "--host", c.host, "--port", "0",
            "--redis-url", self.redis_url, "--kv-cache-memory", c.kv_cache_memory,
            "--kv-backend", c.kv_backend, "--block-size", str(c.block_size),
            "--log-level", c.log_level, "--metrics-port", "0", *c.tls_flags(),
        ]  # fmt: skip

    def start(self) -> str:
        c = self.config
        removed = sweep_stale()
        if removed:
            logger.info("removed %d KV segments of dead processes", removed)
        try:
            if not self.redis_url:
                self.redis = RedisServer().start()
                self.redis_url = self.redis.url
            self.prefill = [
                Child(f"prefill-{i}", pdmesh_command("prefill", *self.engine_args("prefill")),
                      env=self.env)
                for i in range(c.num_prefill)
            ]
            role_args = ["--role", "colocated"] if c.colocated else []
            self.decode = [
                Child(
                    f"{'colocated' if c.colocated else 'decode'}-{i}",
                    pdmesh_command("decode", *self.engine_args("decode"), *role_args),
                    env=self.env,
                )
                for i in range(c.num_decode)
            ]
            for child in [*self.prefill, *self.decode]:  # they start in parallel
                child.wait_ready(c.startup_timeout_s)
            self.router = Child("router", pdmesh_command("router", *self._router_argv()),
                                env=self.env)
            address = self.router.wait_ready(c.startup_timeout_s)
            if c.gateway_port >= 0:
                self.gateway = Child("gateway", pdmesh_command("gateway", *self._gateway_argv()),
                                     env=self.env)
                self.gateway.wait_ready(c.startup_timeout_s)
            return address
        except BaseException:
            self.stop()
            raise

    def _router_argv(self) -> list[str]:
        c = self.config
        argv = [
            "--model", c.model, "--host", c.host, "--port", str(c.port),
            "--redis-url", self.redis_url, "--routing-policy", c.routing_policy,
            "--local-prefill-threshold", str(c.local_prefill_threshold),
            "--log-level", c.log_level, "--metrics-port", "0", *c.tls_flags(),
        ]  # fmt: skip
        if self.prefill:
            argv += ["--prefill", ",".join(p.address or "" for p in self.prefill)]
        argv += ["--decode", ",".join(d.address or "" for d in self.decode)]
        return argv + self.router_args

    def _gateway_argv(self) -> list[str]:
        c = self.config
        argv = [
            "--router-address", self.router_address, "--host", c.host,
            "--port", str(c.gateway_port), "--log-level", c.log_level, *c.tls_flags(),
        ]  # fmt: skip
        return argv + (["--api-key", c.api_key] if c.api_key else [])

    @property
    def gateway_url(self) -> str | None:
        """Base URL of the OpenAI API (`http://host:port/v1`), or None without a gateway."""
        if self.gateway is None or self.gateway.address is None:
            return None
        return f"http://{self.gateway.address}/v1"

    def metrics_urls(self) -> dict[str, str]:
        """Each child's /metrics URL, by child name (the gateway serves it on its API port)."""
        urls = {c.name: c.metrics_url for c in self.children if c.metrics_url}
        if self.gateway is not None and self.gateway.address:
            urls[self.gateway.name] = f"http://{self.gateway.address}/metrics"
        return urls

    @property
    def router_address(self) -> str:
        assert self.router is not None and self.router.address is not None
        return self.router.address

    def sweep_shm(self) -> int:
        """Remove the shared-memory KV segments of children that have exited."""
        exited = [c.pid for c in [*self.prefill, *self.decode] if not c.running()]
        return sweep_stale(pids=exited) if exited else 0

    def stop(self) -> None:
        """Gateway and router first, then engines (all signalled at once), then Redis."""
        for front in (self.gateway, self.router):
            if front is not None:
                front.terminate()
        engines = [*self.prefill, *self.decode]
        for child in engines:
            if child.running():
                child.proc.terminate()
        for child in engines:
            child.terminate()
        self.sweep_shm()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> LocalMesh:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(
        MeshConfig, argv, prog="pdmesh serve",
        description="start redis, prefill and decode engines and the router as local processes",
    )
    logging.basicConfig(level=getattr(logging, config.log_level.upper(), logging.WARNING))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    mesh = LocalMesh(config)
    try:
        address = mesh.start()
    except (ChildFailed, OSError) as exc:
        print(f"pdmesh serve: error: {exc}", file=sys.stderr)
        return 1
    engines = (
        f"{config.num_decode} colocated" if config.colocated
        else f"{config.num_prefill} prefill, {config.num_decode} decode"
    )
    print(f"router listening on {address} (redis {mesh.redis_url}, {engines})", flush=True)
    if mesh.gateway_url:
        print(f"OpenAI API on {mesh.gateway_url}", flush=True)
    for name, url in mesh.metrics_urls().items():
        print(f"metrics {name} {url}", flush=True)
    gateway = f" gateway={mesh.gateway_url}" if mesh.gateway_url else ""
    print(f"ready {address}{gateway}", flush=True)
    exit_code = 0
    reported: set[str] = set()
    try:
        while not stop.wait(timeout=1.0):
            if mesh.router is not None and not mesh.router.running():
                print("pdmesh serve: the router exited; shutting down", file=sys.stderr)
                exit_code = 1
                break
            for child in mesh.children:
                if not child.running() and child.name not in reported:
                    reported.add(child.name)
                    print(f"pdmesh serve: {child.name} exited with code {child.proc.poll()}; "
                          "the router routes around it", file=sys.stderr)
                    mesh.sweep_shm()
    finally:
        mesh.stop()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
