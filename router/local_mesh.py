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

`pdmesh serve` generates a cluster token per run (unless PDMESH_CLUSTER_TOKEN[_FILE] is set)
and hands it to the children through their environment; `LocalMesh` itself passes on whatever
environment it is given.

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
from typing import Any

import torch

from pdmesh import __version__
from pdmesh.auth import TOKEN_ENV, TOKEN_FILE_ENV, ClusterToken
from pdmesh.config import parse_config
from pdmesh.engine.cpu_threads import usable_cpus
from pdmesh.engine.generation_config import check_source
from pdmesh.gateway.tool_parsers import TOOL_PARSERS, check_tool_flags
from pdmesh.kvstore.redis_server import RedisServer
from pdmesh.kvstore.transfer.backends.shm import sweep_stale
from pdmesh.router.routing.base import POLICY_NAMES

logger = logging.getLogger(__name__)


class ChildFailed(RuntimeError):
    """A child exited or stayed silent before printing its ready line."""


def _help(text: str, choices: Sequence[str] = ()) -> dict[str, Any]:
    return {"help": text, "choices": tuple(choices)} if choices else {"help": text}


DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class MeshConfig:
    """`pdmesh serve`'s flags: vLLM's names and meanings where vLLM has the knob (`--port` is
    the OpenAI HTTP port, the model is positional), pdmesh's own for the mesh's shape."""

    model: str = field(default="smollm2", metadata=_help(
        "model alias or HF-format directory (also positional: pdmesh serve MODEL)"))
    served_model_name: str = field(default="", metadata=_help(
        "the name clients ask for (/v1/models id); empty = the model argument"))
    num_prefill: int = field(default=1, metadata=_help("prefill processes"))
    num_decode: int = field(default=1, metadata=_help("decode processes"))
    host: str = field(default="127.0.0.1", metadata=_help("address every service binds"))
    port: int = field(default=8000, metadata=_help(
        "OpenAI HTTP API port; 0 picks a free one, -1 runs no HTTP gateway"))
    grpc_port: int = field(default=0, metadata=_help(
        "router gRPC port (formerly --port); 0 picks a free one"))
    gateway_port: int | None = field(default=None, metadata=_help(
        "deprecated alias of --port"))
    max_model_len: int | None = field(default=None, metadata=_help(
        "context limit in tokens; unset = the model's"))
    max_num_seqs: int = field(default=256, metadata=_help("sequences per engine batch"))
    max_num_batched_tokens: int = field(default=2048, metadata=_help(
        "tokens per engine step"))
    dtype: str = field(default="auto", metadata=_help(
        "weights and KV dtype; auto = float32 on CPU, bfloat16 on CUDA", DTYPES))
    enable_prefix_caching: bool = field(default=True, metadata=_help(
        "reuse the KV of shared prompt prefixes"))
    seed: int = field(default=0, metadata=_help("engines' seed for unseeded requests"))
    enforce_eager: bool = field(default=False, metadata=_help(
        "never capture CUDA graphs for decode steps (no effect on CPU)"))
    async_scheduling: bool | None = field(default=None, metadata=_help(
        "launch each engine step before the previous one's tokens reach the host; unset: on "
        "for CUDA, off on CPU"))
    engine_core_process: bool = field(default=True, metadata=_help(
        "run each engine's core (scheduler, KV cache, model) in its own process"))
    cpu_threads: int | None = field(default=None, metadata=_help(
        "torch threads per engine core; default on CPU: this host's CPUs shared among the "
        "engines"))
    stream_interval: int = field(default=1, metadata=_help(
        "stream a request's output once this many new tokens are pending (the first and "
        "the last at once): fewer, larger messages on every hop"))
    chat_template: str | None = field(default=None, metadata=_help(
        "a Jinja chat template (file or text) replacing the model's"))
    enable_auto_tool_choice: bool = field(default=False, metadata=_help(
        'tool_choice "auto": parse tool calls out of the output with --tool-call-parser'))
    tool_call_parser: str | None = field(default=None, metadata=_help(
        "how the model writes tool calls (for --enable-auto-tool-choice)",
        tuple(TOOL_PARSERS)))
    generation_config: str = field(default="auto", metadata=_help(
        "sampling defaults: auto (the model's generation_config.json), vllm (none) or a "
        "directory holding a generation_config.json", ("auto", "vllm", "PATH")))
    redis_url: str | None = field(
        default=None, metadata=_help("use this Redis instead of starting one")
    )
    routing_policy: str = field(default="prefix_aware",
                                metadata=_help("router policy", POLICY_NAMES))
    local_prefill_threshold: int = field(
        default=256, metadata=_help("decode prefills locally below this many uncached tokens")
    )
    kv_cache_memory: str = field(default="512MiB", metadata=_help(
        "KV budget per engine: bytes, e.g. 2GiB, or a fraction of free memory, e.g. 0.5"))
    gpu_memory_utilization: float | None = field(default=None, metadata=_help(
        "CUDA: fraction of GPU memory per engine, weights included (replaces "
        "--kv-cache-memory there)"))
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
    api_key: str | None = field(default=None, metadata=_help(
        "require 'Authorization: Bearer <key>' on /v1/* (better: env PDMESH_API_KEY)"))
    allowed_origins: tuple[str, ...] = field(default=(), metadata=_help(
        "CORS: origins browsers may call the HTTP API from, comma-separated or a JSON list; "
        "* = any; empty = no CORS"))
    allowed_methods: tuple[str, ...] = field(default=("*",), metadata=_help(
        "CORS: allowed methods"))
    allowed_headers: tuple[str, ...] = field(default=("*",), metadata=_help(
        "CORS: allowed request headers"))
    allow_credentials: bool = field(default=False, metadata=_help(
        "CORS: allow credentials (cookies, auth headers)"))
    startup_timeout_s: float = field(default=180.0, metadata=_help("per-child ready deadline"))
    log_level: str = field(default="warning", metadata=_help("children's log level"))

    def __post_init__(self) -> None:
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be >= 1, got {self.cpu_threads}")
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("--num-decode must be >= 1 and --num-prefill >= 0")
        if self.routing_policy not in POLICY_NAMES:
            raise ValueError(f"--routing-policy must be one of {', '.join(POLICY_NAMES)}")
        if self.colocated:
            self.num_prefill = 0
        if self.gateway_port is not None:
            self.port = self.gateway_port
            self.gateway_port = None
        if not -1 <= self.port <= 65535:
            raise ValueError("--port must be -1 (no HTTP API), 0 (a free port) or a port")
        if not 0 <= self.grpc_port <= 65535:
            raise ValueError("--grpc-port must be 0 (a free port) or a port")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        check_source(self.generation_config)
        check_tool_flags(self.enable_auto_tool_choice, self.tool_call_parser)
        if self.startup_timeout_s <= 0:
            raise ValueError("--startup-timeout-s must be > 0")

    @property
    def http_port(self) -> int:
        """The OpenAI HTTP port (-1: no gateway). `gateway_port` is folded into `port`."""
        return self.port

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
        argv = [
            "--model", c.model, "--host", c.host, "--port", "0",
            "--redis-url", self.redis_url, "--kv-cache-memory", c.kv_cache_memory,
            "--kv-backend", c.kv_backend, "--block-size", str(c.block_size),
            "--max-num-seqs", str(c.max_num_seqs),
            "--max-num-batched-tokens", str(c.max_num_batched_tokens),
            "--dtype", c.dtype, "--seed", str(c.seed),
            "--stream-interval", str(c.stream_interval),
            "--log-level", c.log_level, "--metrics-port", "0", *c.tls_flags(),
        ]  # fmt: skip
        if c.served_model_name:
            argv += ["--served-model-name", c.served_model_name]
        if c.max_model_len is not None:
            argv += ["--max-model-len", str(c.max_model_len)]
        if not c.enable_prefix_caching:
            argv += ["--no-enable-prefix-caching"]
        if c.enforce_eager:
            argv += ["--enforce-eager"]
        if c.async_scheduling is not None:
            argv += ["--async-scheduling" if c.async_scheduling else "--no-async-scheduling"]
        if not c.engine_core_process:
            argv += ["--no-engine-core-process"]
        if c.gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", str(c.gpu_memory_utilization)]
        threads = c.cpu_threads if c.cpu_threads is not None else self._cpu_share()
        if threads is not None:
            argv += ["--cpu-threads", str(threads)]
        return argv

    def _cpu_share(self) -> int | None:
        """On a CPU-only host with several engines: each core's share of the CPUs, so their
        threads together do not outnumber them (engine/cpu_threads.py says why). None leaves
        each core its own choice (one engine, CUDA, or OMP_NUM_THREADS set)."""
        c = self.config
        engines = c.num_prefill + c.num_decode
        env = os.environ if self.env is None else self.env
        if engines < 2 or torch.cuda.is_available() or env.get("OMP_NUM_THREADS"):
            return None
        return max(1, usable_cpus() // engines)

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
            if c.http_port >= 0:
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
            "--model", c.model, "--host", c.host, "--port", str(c.grpc_port),
            "--redis-url", self.redis_url, "--routing-policy", c.routing_policy,
            "--local-prefill-threshold", str(c.local_prefill_threshold),
            "--generation-config", c.generation_config,
            "--log-level", c.log_level, "--metrics-port", "0", *c.tls_flags(),
        ]  # fmt: skip
        if c.served_model_name:
            argv += ["--served-model-name", c.served_model_name]
        if c.chat_template:
            argv += ["--chat-template", c.chat_template]
        if self.prefill:
            argv += ["--prefill", ",".join(p.address or "" for p in self.prefill)]
        argv += ["--decode", ",".join(d.address or "" for d in self.decode)]
        return argv + self.router_args

    def _gateway_argv(self) -> list[str]:
        c = self.config
        argv = [
            "--router-address", self.router_address, "--host", c.host,
            "--port", str(c.http_port), "--log-level", c.log_level, *c.tls_flags(),
        ]  # fmt: skip
        if c.tls_cert and c.tls_key:  # a TLS mesh serves HTTPS too (no client certificates)
            argv += ["--ssl-certfile", c.tls_cert, "--ssl-keyfile", c.tls_key]
        if c.allowed_origins:
            argv += ["--allowed-origins", ",".join(c.allowed_origins),
                     "--allowed-methods", ",".join(c.allowed_methods),
                     "--allowed-headers", ",".join(c.allowed_headers),
                     "--allow-credentials" if c.allow_credentials else "--no-allow-credentials"]
        if c.enable_auto_tool_choice:
            argv += ["--enable-auto-tool-choice"]
        if c.tool_call_parser:
            argv += ["--tool-call-parser", c.tool_call_parser]
        return argv + (["--api-key", c.api_key] if c.api_key else [])

    @property
    def gateway_url(self) -> str | None:
        """Base URL of the OpenAI API (`http[s]://host:port/v1`), or None without a gateway."""
        if self.gateway is None or self.gateway.address is None:
            return None
        return f"{self._http_scheme}://{self.gateway.address}/v1"

    @property
    def _http_scheme(self) -> str:
        return self.gateway.fields.get("scheme", "http") if self.gateway else "http"

    def metrics_urls(self) -> dict[str, str]:
        """Each child's /metrics URL, by child name (the gateway serves it on its API port)."""
        urls = {c.name: c.metrics_url for c in self.children if c.metrics_url}
        if self.gateway is not None and self.gateway.address:
            urls[self.gateway.name] = f"{self._http_scheme}://{self.gateway.address}/metrics"
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


def with_cluster_token(env: dict[str, str]) -> dict[str, str]:
    """`env` with a fresh cluster token unless one is configured: `pdmesh serve` makes one per
    run, so its engines only answer the router (docs/SECURITY.md). It travels in the
    children's environment, never on a command line."""
    if not (env.get(TOKEN_ENV) or env.get(TOKEN_FILE_ENV)):
        env[TOKEN_ENV] = ClusterToken.generate().value
    return env


def _positional_model(argv: Sequence[str]) -> list[str]:
    """`pdmesh serve MODEL [flags]` as vLLM spells it -> `--model MODEL [flags]`."""
    args = list(argv)
    if args and not args[0].startswith("-"):
        return ["--model", args[0], *args[1:]]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(
        MeshConfig, _positional_model(sys.argv[1:] if argv is None else argv),
        prog="pdmesh serve [MODEL]",
        description=f"pdmesh {__version__}: start redis, prefill and decode engines, the "
                    "router and the OpenAI HTTP API as local processes. MODEL (or --model) is "
                    "an alias or an HF-format directory; --port is the HTTP port, as in "
                    "`vllm serve`, and --grpc-port the router's.",
    )
    logging.basicConfig(level=getattr(logging, config.log_level.upper(), logging.WARNING))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    mesh = LocalMesh(config, env=with_cluster_token(dict(os.environ)))
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
