"""Data-plane backends, imported lazily so optional libraries (ucxx) stay optional.

Each module defines `Server`, `Client` and `unavailable_reason() -> str | None`. Which ones
can be used is answered without importing them (`availability.py`: they import torch, which
an engine service whose core moves KV itself never loads).
"""

from __future__ import annotations

import importlib
import sys
from concurrent.futures import Executor
from types import ModuleType

from pdmesh.kvstore.transfer.backends.availability import REASONS
from pdmesh.kvstore.transfer.backends.base import (
    DataPlaneClient,
    DataPlaneConfig,
    DataPlaneServer,
)
from pdmesh.kvstore.transfer.errors import KVBackendUnavailable
from pdmesh.kvstore.transfer.lease import LeaseTable

TLS_SAFE_BACKENDS = ("shm", "tcp")
"""Data planes allowed on a TLS mesh: shm never leaves the host, tcp speaks TLS. ucxx and
torch_dist have no TLS here, so a sender with TLS refuses them and a receiver skips them."""

_MODULES = {
    "shm": "pdmesh.kvstore.transfer.backends.shm",
    "tcp": "pdmesh.kvstore.transfer.backends.tcp",
    "ucxx": "pdmesh.kvstore.transfer.backends.ucx",
    "torch_dist": "pdmesh.kvstore.transfer.backends.torch_dist",
}


_torch_threads: int | None = None


def limit_torch_threads(count: int) -> None:
    """This process's torch runs `count` threads: now if loaded, else once a plane loads it.

    A serving process whose core moves KV loads torch only with a staged plane; its torch
    must not start a spinning thread per CPU beside the core's (engine/worker/cpu_threads.py)."""
    global _torch_threads
    _torch_threads = count
    _apply_torch_threads()


def _apply_torch_threads() -> None:
    torch = sys.modules.get("torch")
    if _torch_threads is not None and torch is not None:
        torch.set_num_threads(_torch_threads)


def _module(name: str) -> ModuleType:
    if name not in _MODULES:
        raise KVBackendUnavailable(f"unknown KV transfer backend {name!r}")
    module = importlib.import_module(_MODULES[name])
    _apply_torch_threads()
    reason = module.unavailable_reason()
    if reason is not None:
        raise KVBackendUnavailable(f"backend {name!r} unavailable: {reason}")
    return module


def unavailable_reason(name: str) -> str | None:
    """None if `name` can be used in this process, else why not (without importing it)."""
    if name not in _MODULES:
        return f"unknown KV transfer backend {name!r}"
    reason = REASONS[name]()
    return None if reason is None else f"backend {name!r} unavailable: {reason}"


def available_backends() -> tuple[str, ...]:
    return tuple(name for name in _MODULES if unavailable_reason(name) is None)


def make_server(name: str, table: LeaseTable, config: DataPlaneConfig) -> DataPlaneServer:
    return _module(name).Server(table, config)


def make_client(
    name: str, config: DataPlaneConfig, executor: Executor | None = None
) -> DataPlaneClient:
    return _module(name).Client(config, executor)


__all__ = [
    "TLS_SAFE_BACKENDS",
    "DataPlaneClient",
    "DataPlaneConfig",
    "DataPlaneServer",
    "available_backends",
    "limit_torch_threads",
    "make_client",
    "make_server",
    "unavailable_reason",
]
