"""What `pdmesh serve` tells each child: its config, built from the mesh's, as a command line.

One rule for every child (engines, router, gateway), by name: each setting of the mesh (its own
and its engine's) that the child's config declares too is handed to it, except those whose
meaning differs here (`NOT_HANDED_ON`); on top come the settings `pdmesh serve` decides per
child, its *placement* (addresses, ports, Redis), which are always on its command line. The
child's config is built here, in `pdmesh serve`'s process, so it is validated before anything
starts, then rendered into flags by `pdmesh.config.config_argv`. A setting declared once (in
`EngineConfig`, or in a child's config and offered by `MeshConfig`) so reaches every child
that takes it, with no command line written by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from pdmesh.config import build_config, config_argv, settings, values_of
from pdmesh.decode_svc.config import DecodeConfig
from pdmesh.engine.config import AUTO, DEFAULT_GPU_MEMORY_UTILIZATION
from pdmesh.gateway.config import GatewayConfig
from pdmesh.prefill_svc.config import PrefillConfig
from pdmesh.router.config import RouterConfig

if TYPE_CHECKING:
    from pdmesh.serve.config import MeshConfig

C = TypeVar("C")

NOT_HANDED_ON = frozenset({"port", "api_key"})
"""Mesh settings no child takes by name: `--port` is the mesh's HTTP port (each child's port is
its placement), and the API key travels in the gateway's environment (`ps` shows argv)."""

ENGINE_CONFIGS: dict[str, type[PrefillConfig] | type[DecodeConfig]] = {
    "prefill": PrefillConfig, "decode": DecodeConfig, "colocated": DecodeConfig,
}
"""The config class of each kind of engine child."""

STAND_IN_ADDRESS = "127.0.0.1:1"
"""Where `check_children` pretends the children it builds serve (never dialled)."""


def handed_on(mesh: MeshConfig, cls: type) -> dict[str, Any]:
    """The mesh's settings that a child whose config is `cls` takes: those it declares too.
    An unset one (None) is left to the child: its own default, or its environment's."""
    theirs = settings(cls)
    return {name: value for name, value in values_of(mesh).items()
            if name in theirs and name not in NOT_HANDED_ON and value is not None}


def child_config(cls: type[C], mesh: MeshConfig, placement: Mapping[str, Any]) -> C:
    """The config of a child of `cls` placed by `placement`; raises ValueError naming the flag
    of a setting it refuses."""
    return build_config(cls, {**handed_on(mesh, cls), **placement})


def child_argv(cls: type, mesh: MeshConfig, placement: Mapping[str, Any]) -> list[str]:
    """The flags of that child: its placement, and what it takes from the mesh that differs
    from its own defaults."""
    return config_argv(child_config(cls, mesh, placement), always=placement)


def engine_placement(kind: str, mesh: MeshConfig, *, redis_url: str, port: int = 0,
                     metrics_port: int = 0, cpu_threads: int | None = None,
                     memory: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Where an engine of `kind` (prefill, decode or colocated) serves; `cpu_threads`: its
    share of this host's CPUs, if `pdmesh serve` chose one; `memory`: its KV budget settings
    (`engine_memory`)."""
    placement: dict[str, Any] = {"model": mesh.model, "host": mesh.host, "port": port,
                                 "metrics_port": metrics_port, "redis_url": redis_url}
    if kind == "colocated":
        placement["role"] = "colocated"
    if mesh.tensor_parallel_size(kind) != mesh.engine.tensor_parallel_size:
        placement["tensor_parallel_size"] = mesh.tensor_parallel_size(kind)
    if cpu_threads is not None:
        placement["cpu_threads"] = cpu_threads
    placement.update(memory or {})
    return placement


SERVE_CPU_KV_CACHE_MEMORY = "512MiB"
"""`pdmesh serve --kv-cache-memory auto` on CPU: half an engine's own default, as several
engines share the host."""


def engine_memory(mesh: MeshConfig, on_cuda: bool) -> dict[str, Any]:
    """Each engine's KV budget settings when `--kv-cache-memory` is auto (none otherwise: the
    given budget is handed on by name). On CPU a fixed budget; on CUDA every engine runs on
    the same GPU, so each takes `--gpu-memory-utilization` when given (vLLM's per-instance
    meaning), else an equal part of vLLM's default 0.9: their shares must add up to at most
    the whole GPU, or the later ones find their share taken at start-up."""
    if mesh.kv_cache_memory != AUTO:
        return {}
    if not on_cuda:
        return {"kv_cache_memory": SERVE_CPU_KV_CACHE_MEMORY}
    if mesh.engine.gpu_memory_utilization is not None:
        return {}
    engines = mesh.num_prefill + mesh.num_decode
    return {"gpu_memory_utilization": round(DEFAULT_GPU_MEMORY_UTILIZATION / engines, 4)}


def router_placement(mesh: MeshConfig, *, redis_url: str, port: int, metrics_port: int,
                     prefill: list[str], decode: list[str]) -> dict[str, Any]:
    """Where the router serves, and the engines it starts with (Redis tells it of the rest)."""
    placement: dict[str, Any] = {"model": mesh.model, "host": mesh.host, "port": port,
                                 "metrics_port": metrics_port, "redis_url": redis_url,
                                 "decode": tuple(decode)}
    if prefill:
        placement["prefill"] = tuple(prefill)
    return placement


def gateway_placement(mesh: MeshConfig, *, router_address: str, port: int,
                      metrics: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Where the gateway serves, and its router. A TLS mesh serves HTTPS too (with the mesh's
    certificate, no client certificates) unless --ssl-certfile/--ssl-keyfile say otherwise.
    `metrics`: every other child's /metrics URL by child name, which the gateway's /metrics
    serves too (one scrape for the mesh: gateway/metrics_federation.py)."""
    placement: dict[str, Any] = {"router_address": router_address, "host": mesh.host,
                                 "port": port, "model_root": mesh.model}
    if metrics:
        placement["metrics_federate"] = tuple(f"{name}={url}" for name, url in metrics.items())
    if mesh.tls_cert and mesh.tls_key and not mesh.ssl_certfile:
        placement.update(ssl_certfile=mesh.tls_cert, ssl_keyfile=mesh.tls_key)
    return placement


def check_children(mesh: MeshConfig) -> None:
    """Build every child's config with stand-in addresses: a setting some child refuses stops
    `pdmesh serve` before anything starts, naming its flag."""
    redis_url = mesh.redis_url or f"redis://{STAND_IN_ADDRESS}/0"
    kinds = ["colocated"] if mesh.colocated else ["prefill", "decode"]
    for kind in kinds:
        child_config(ENGINE_CONFIGS[kind], mesh, engine_placement(kind, mesh, redis_url=redis_url))
    child_config(RouterConfig, mesh, router_placement(
        mesh, redis_url=redis_url, port=0, metrics_port=0, prefill=[STAND_IN_ADDRESS],
        decode=[STAND_IN_ADDRESS]))
    if mesh.http_port >= 0:
        child_config(GatewayConfig, mesh, gateway_placement(
            mesh, router_address=STAND_IN_ADDRESS, port=0,
            metrics={"router": f"http://{STAND_IN_ADDRESS}/metrics"}))
