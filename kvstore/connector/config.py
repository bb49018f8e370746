"""`KVConnectorConfig`: how an engine core lends and pulls KV blocks (declared once; the
engine services map their flags onto it and hand it to the core at boot)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pdmesh.config import about

DEFAULT_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


@dataclass(frozen=True)
class KVConnectorConfig:
    shared_cache: bool = field(default=True, metadata=about(
        "CPU: allocate the KV cache in a shared-memory file, so a peer core on this host "
        "copies blocks straight out of it (one copy)"))
    shm_dir: str = field(default=DEFAULT_SHM_DIR, metadata=about(
        "directory of the shared KV cache file"))
    tcp: bool = field(default=True, metadata=about(
        "serve blocks over TCP from the core (cross-host pulls)"))
    tcp_host: str = field(default="127.0.0.1", metadata=about(
        "bind address of the core's block server"))
    tcp_advertise_host: str = field(default="", metadata=about(
        "address peers dial for blocks (default: tcp_host)"))
    ucx: bool = field(default=False, metadata=about(
        "serve blocks over UCX (ucxx) from the core too, where the package is installed: host "
        "or device memory, no staging copy (its listener's address is advertised like "
        "tcp_advertise_host)"))
    tcp_connections: int = field(default=2, metadata=about(
        "parallel TCP connections per pull"))
    io_timeout_s: float = field(default=30.0, metadata=about(
        "bound on any single blocking socket step"))
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    grant_secret: str = field(default="", metadata=about(
        "hex key the serving process signs granted pulls with (generated; never a flag)"))
    owner_pid: int = field(default=0, metadata=about(
        "the process whose pid names the cache file (the serving process of a core in its own "
        "process, so the sweeps after a dead service find it); 0: the core's own"))

    def __post_init__(self) -> None:
        if self.tcp_connections < 1:
            raise ValueError(f"tcp_connections must be >= 1, got {self.tcp_connections}")
        if self.io_timeout_s <= 0:
            raise ValueError(f"io_timeout_s must be > 0, got {self.io_timeout_s}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("the block server's TLS needs both a certificate and a key")

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_cert or self.tls_ca)
