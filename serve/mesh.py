"""`LocalMesh`: a whole mesh on this machine, as real processes (what `pdmesh serve` runs).

Starts a Redis for the cluster index (a real redis-server, see kvstore/redis_server.py) unless
`--redis-url` names one, then N prefill and M decode engine processes (or, with `--colocated`,
engines that do both), the router and the OpenAI REST gateway, each as
`python -m pdmesh.cli <role> ...` with the flags serve/child_config.py renders from the mesh's
config. Each is waited for until it prints its ready line (serve/child.py). `stop()` stops the
children (SIGTERM, then SIGKILL after a grace period) in reverse order: router first, so no new
request reaches an engine that is going away.

`supervise()` restarts any child that dies (router, gateway, Redis, an engine) with a capped
exponential backoff (serve/supervisor.py), and the reason it ended is logged. A restarted child
serves where it served before (its gRPC, HTTP and metrics ports are pinned at their first
start), so the router still knows its engines, the gateway its router, and clients the HTTP
port. Streams that a dead router or gateway carried are lost with it; those of a dead engine
the router migrates. Tests that kill children on purpose leave supervision off.

Every child serves Prometheus metrics on a free port (`--metrics-port 0`); its URL comes back
in the ready line (`metrics=http://...`, `Child.metrics_url`). The gateway is told them all
(`--metrics-federate`), so its /metrics on the HTTP port is one scrape of the whole mesh, each
series labelled with its child's name (`service`). The OTEL_* variables of this
process (or of `env`) reach every child unchanged, so one `OTEL_EXPORTER_OTLP_ENDPOINT` traces
the whole mesh. `LocalMesh` passes on whatever environment it is given (`pdmesh serve` adds a
cluster token to it).

KV segments that a prefill child leaves in shared memory when it dies without cleaning up
(SIGKILL), and the socket directory of its engine core, are removed when the mesh notices the
exit, on stop, and (those of any dead process) on start; both are named after the pid of the
child that created them.

`LocalMesh` is also the test harness: tests start, inspect and kill its children.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence
from functools import partial
from types import TracebackType

from pdmesh.devices import engines_use_cuda
from pdmesh.engine.worker.cpu_threads import usable_cpus
from pdmesh.gateway.config import GatewayConfig
from pdmesh.grpc_common import TEARDOWN_BOUND_S
from pdmesh.kvstore.redis_server import RedisServer
from pdmesh.leftovers import sweep_core_dirs
from pdmesh.leftovers import sweep_kv_segments as sweep_stale
from pdmesh.router.config import RouterConfig
from pdmesh.serve.child import Child, Endpoint, pdmesh_command
from pdmesh.serve.child_config import (
    ENGINE_CONFIGS,
    child_argv,
    engine_memory,
    engine_placement,
    gateway_placement,
    router_placement,
)
from pdmesh.serve.config import MeshConfig
from pdmesh.serve.supervisor import Backoff, ChildSpec, Supervised, Supervisor

logger = logging.getLogger(__name__)

DRAIN_ENV, DEFAULT_DRAIN_TIMEOUT_S = "PDMESH_DRAIN_TIMEOUT_S", 30.0
"""Every child's `--drain-timeout-s`, from its environment unless `pdmesh serve` sets it."""
API_KEY_ENV = "PDMESH_API_KEY"
NAMES_ENV = "PDMESH_METRICS_NAMES"  # pdmesh/metrics_vllm.py reads it
"""How the gateway child gets `--api-key`: `ps` shows a command line to every user."""


class RedisChild:
    """The mesh's redis-server as the supervisor sees a child."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server

    @property
    def pid(self) -> int | None:
        return self.server.pid

    def poll(self) -> int | None:
        return self.server.returncode

    def wait_ready(self, timeout_s: float) -> str:
        return self.server.url  # RedisServer.start() returned once it answered

    def kill(self) -> int:
        status = self.server.returncode
        self.server.kill()
        return -signal.SIGKILL if status is None else status


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
        self.endpoints: dict[str, Endpoint] = {}  # by child name, from its first start
        self.pinned_metrics: dict[str, str] = {}  # /metrics URL by child name, first start's
        self.supervisor: Supervisor | None = None

    @property
    def children(self) -> list[Child]:
        front = [c for c in (self.router, self.gateway) if c is not None]
        return [*self.prefill, *self.decode, *front]

    def engine_args(self, kind: str, endpoint: Endpoint | None = None) -> list[str]:
        """`pdmesh prefill|decode` flags of an engine of `kind` (prefill, decode or
        colocated); `endpoint`: the ports a restarted engine keeps."""
        port, metrics_port = (endpoint.port, endpoint.metrics_port) if endpoint else (0, 0)
        threads = None if self.config.engine.cpu_threads is not None else self._cpu_share()
        if threads is not None:  # a thread for each rank at least (engine/core/ranks.py)
            threads = max(threads, self.config.tensor_parallel_size(kind))
        memory = engine_memory(self.config, engines_use_cuda(self.config.engine.device))
        placement = engine_placement(kind, self.config, redis_url=self.redis_url, port=port,
                                     metrics_port=metrics_port, cpu_threads=threads,
                                     memory=memory)
        return child_argv(ENGINE_CONFIGS[kind], self.config, placement)

    def _cpu_share(self) -> int | None:
        """On a CPU-only host with several engines: each core's share of the CPUs, so their
        threads together do not outnumber them (engine/worker/cpu_threads.py says why). None leaves
        each core its own choice (one engine, CUDA, or OMP_NUM_THREADS set)."""
        c = self.config
        engines = c.num_prefill + c.num_decode
        env = os.environ if self.env is None else self.env
        if engines < 2 or engines_use_cuda(c.engine.device) or env.get("OMP_NUM_THREADS"):
            return None
        return max(1, usable_cpus() // engines)

    def start(self) -> str:
        c = self.config
        removed = sweep_stale()
        if removed:
            logger.info("removed %d KV segments of dead processes", removed)
        if swept := sweep_core_dirs():
            logger.info("removed %d engine core socket dirs of dead processes", swept)
        try:
            if not self.redis_url:
                self.redis = RedisServer().start()
                self.redis_url = self.redis.url
            self.prefill = [self._engine_child("prefill", i) for i in range(c.num_prefill)]
            self.decode = [self._engine_child(self._decode_kind, i) for i in range(c.num_decode)]
            for child in [*self.prefill, *self.decode]:  # they start in parallel
                self._wait_ready(child)
            self.router = self._router_child()
            address = self._wait_ready(self.router)
            if c.http_port >= 0:
                self.gateway = self._gateway_child()
                self._wait_ready(self.gateway)
            return address
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, child: Child) -> str:
        address = child.wait_ready(self.config.startup_timeout_s)
        self.endpoints[child.name] = Endpoint.of(child)
        if child.metrics_url:
            self.pinned_metrics.setdefault(child.name, child.metrics_url)
        return address

    @property
    def _decode_kind(self) -> str:
        return "colocated" if self.config.colocated else "decode"

    def _engine_child(self, kind: str, index: int) -> Child:
        """Engine `index` of `kind` (prefill, decode or colocated), on its pinned ports if it
        served before."""
        name = f"{kind}-{index}"
        role = "prefill" if kind == "prefill" else "decode"
        argv = pdmesh_command(role, *self.engine_args(kind, self.endpoints.get(name)))
        return Child(name, argv, env=self._service_env())

    def _router_child(self) -> Child:
        argv = self._router_argv(self.endpoints.get("router"))
        return Child("router", pdmesh_command("router", *argv), env=self._service_env())

    def _service_env(self) -> dict[str, str] | None:
        """An engine's or the router's environment: `env`, plus `--metrics-names` (which they
        take as PDMESH_METRICS_NAMES, so their own /metrics ports name alike)."""
        if self.config.metrics_names == "pdmesh":
            return self.env
        return {**(os.environ if self.env is None else self.env),
                NAMES_ENV: self.config.metrics_names}

    def _gateway_child(self) -> Child:
        argv = self._gateway_argv(self.endpoints.get("gateway"))
        return Child("gateway", pdmesh_command("gateway", *argv), env=self._gateway_env())

    def _router_argv(self, endpoint: Endpoint | None = None) -> list[str]:
        """`pdmesh router` flags (then `router_args`); `endpoint`: the ports a restarted
        router keeps."""
        port, metrics_port = (endpoint.port, endpoint.metrics_port) if endpoint else (
            self.config.grpc_port, 0)
        placement = router_placement(
            self.config, redis_url=self.redis_url, port=port, metrics_port=metrics_port,
            prefill=[self._address(p) for p in self.prefill],
            decode=[self._address(d) for d in self.decode])
        return child_argv(RouterConfig, self.config, placement) + self.router_args

    def _address(self, child: Child) -> str:
        """Where `child` serves: where it first did (a restart keeps it), else where it does."""
        pinned = self.endpoints.get(child.name)
        return pinned.address if pinned else child.address or ""

    def _gateway_argv(self, endpoint: Endpoint | None = None) -> list[str]:
        """`pdmesh gateway` flags; `endpoint`: the port a restarted gateway keeps."""
        metrics = {name: url for name, url in self.pinned_metrics.items() if name != "gateway"}
        placement = gateway_placement(self.config, router_address=self.router_address,
                                      port=endpoint.port if endpoint else self.config.http_port,
                                      metrics=metrics)
        return child_argv(GatewayConfig, self.config, placement)

    def _gateway_env(self) -> dict[str, str]:
        """The API key travels in the environment: on a command line `ps` would show it."""
        env = dict(os.environ if self.env is None else self.env)
        if self.config.api_key:
            env[API_KEY_ENV] = self.config.api_key
        return env

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
        """Each child's /metrics URL, by child name (the gateway serves it on its API port, and
        every other child's there too)."""
        urls = {c.name: c.metrics_url for c in self.children if c.metrics_url}
        if self.gateway is not None and self.gateway.address:
            urls[self.gateway.name] = f"{self._http_scheme}://{self.gateway.address}/metrics"
        return urls

    @property
    def router_address(self) -> str:
        pinned = self.endpoints.get("router")
        if pinned is not None:
            return pinned.address
        assert self.router is not None and self.router.address is not None
        return self.router.address

    # -- supervision -----------------------------------------------------------------------------
    def supervise(self, backoff: Backoff | None = None) -> Supervisor:
        """From now on restart every child that dies (`pdmesh serve`), after `start()`."""
        supervisor = Supervisor()
        spec = partial(ChildSpec, startup_timeout_s=self.config.startup_timeout_s,
                       backoff=backoff or Backoff())
        if self.redis is not None:
            supervisor.watch(spec("redis", self._launch_redis, on_launch=self._adopt_redis,
                                  on_exit=_stop_redis), RedisChild(self.redis))
        for kind, slots in (("prefill", self.prefill), (self._decode_kind, self.decode)):
            for i, child in enumerate(slots):
                supervisor.watch(spec(
                    child.name, lambda kind=kind, i=i: self._engine_child(kind, i),
                    on_launch=lambda new, slots=slots, i=i: slots.__setitem__(i, new),
                    on_exit=_after_engine), child)
        if self.router is not None:
            supervisor.watch(spec("router", self._router_child,
                                  on_launch=lambda new: setattr(self, "router", new)),
                             self.router)
        if self.gateway is not None:
            supervisor.watch(spec("gateway", self._gateway_child,
                                  on_launch=lambda new: setattr(self, "gateway", new)),
                             self.gateway)
        self.supervisor = supervisor
        return supervisor

    def _launch_redis(self) -> RedisChild:
        assert self.redis is not None
        return RedisChild(RedisServer(port=self.redis.port).start())  # the URL everyone has

    def _adopt_redis(self, child: Supervised) -> None:
        assert isinstance(child, RedisChild)
        self.redis = child.server

    def sweep_shm(self) -> int:
        """Remove the shared-memory KV segments (and core socket dirs) of children that have
        exited."""
        exited = [c.pid for c in [*self.prefill, *self.decode] if not c.running()]
        if not exited:
            return 0
        sweep_core_dirs(pids=exited)
        return sweep_stale(pids=exited)

    @property
    def stop_grace_s(self) -> float:
        """How long a stopped child gets before SIGKILL: its drain (as configured, or as its
        environment sets it), then its teardown, which its own watchdog bounds, then a margin."""
        drain_s = self.config.drain_timeout_s
        if drain_s is None:
            env = os.environ if self.env is None else self.env
            try:
                drain_s = float(env.get(DRAIN_ENV, DEFAULT_DRAIN_TIMEOUT_S))
            except ValueError:  # the children refuse to start with it anyway
                drain_s = DEFAULT_DRAIN_TIMEOUT_S
        return drain_s + TEARDOWN_BOUND_S + 5.0

    def stop(self) -> None:
        """Gateway and router first, then engines (all signalled at once), then Redis."""
        if self.supervisor is not None:
            self.supervisor.stop()  # no restarts from here on
        grace_s = self.stop_grace_s
        for front in (self.gateway, self.router):
            if front is not None:
                front.terminate(grace_s)
        engines = [*self.prefill, *self.decode]
        for child in engines:
            if child.running():
                child.proc.terminate()
        for child in engines:
            child.terminate(grace_s)
        self.sweep_shm()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self.supervisor is not None:
            self.supervisor.join()

    def __enter__(self) -> LocalMesh:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()




def _after_engine(child: Supervised, status: int) -> None:
    """What a dead engine could not clean up itself: its KV segments, its core's sockets."""
    if child.pid is not None:
        sweep_stale(pids=[child.pid])
        sweep_core_dirs(pids=[child.pid])


def _stop_redis(child: Supervised, status: int) -> None:
    """A dead redis-server's work directory."""
    assert isinstance(child, RedisChild)
    child.server.stop()


