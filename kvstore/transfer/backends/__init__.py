"""Data-plane backends, imported lazily so optional libraries (ucxx) stay optional.

Each module defines `Server`, `Client` and `unavailable_reason() -> str | None`.
"""

from __future__ import annotations

import importlib
from concurrent.futures import Executor
from types import ModuleType

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


def _module(name: str) -> ModuleType:
    if name not in _MODULES:
        raise KVBackendUnavailable(f"unknown KV transfer backend {name!r}")
    module = importlib.import_module(_MODULES[name])
    reason = module.unavailable_reason()
    if reason is not None:
        raise KVBackendUnavailable(f"backend {name!r} unavailable: {reason}")
    return module


def unavailable_reason(name: str) -> str | None:
    """None if `name` can be used in this process, else why not."""
    try:
        _module(name)
    except KVBackendUnavailable as exc:
        return str(exc)
    return None


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
    "make_client",
    "make_server",
    "unavailable_reason",
]
