"""Configuration every engine process shares, whatever its role, validated at start-up.

`EngineServiceConfig` holds what every engine process needs (addresses, Redis, TLS, transfer
backend) and embeds the engine's own knobs (`engine: EngineConfig`: model, KV budget, batch
sizes, ...), so those are declared once; `PrefillConfig` (prefill_svc/config.py) and
`DecodeConfig` (decode_svc/config.py) add their role's knobs. Values come from defaults <
PDMESH_<FIELD> env vars < CLI flags (`pdmesh.config.parse_config`); every error names the flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from pdmesh.auth import ClusterToken, load_cluster_token
from pdmesh.config import about
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.frontend.stall import StallConfig
from pdmesh.grpc_common import DEFAULT_MAX_MESSAGE_BYTES, TLSConfig
from pdmesh.kvstore.transfer.backend_names import BACKEND_NAMES

KV_BACKENDS = ("auto", *BACKEND_NAMES)
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class EngineServiceConfig:
    # Every engine knob (--model, --block-size, --kv-cache-memory, ...): declared once, in
    # EngineConfig; `parse_config` gives its fields their flags and env vars.
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str = field(default="", metadata=about(
        "name in the registry; empty = --model"))
    host: str = field(default="127.0.0.1", metadata=about("gRPC bind address"))
    port: int = field(default=0, metadata=about("gRPC port; 0 picks a free one"))
    advertise_host: str = field(default="", metadata=about(
        "address others dial; empty = --host"))
    redis_url: str = field(default="", metadata=about(
        "redis://host:port/db of the cluster index; empty = run without Redis"))
    heartbeat_ttl_s: float = field(default=10.0, metadata=about("registration TTL (seconds)"))
    kv_backend: str = field(default="auto", metadata=about(
        "KV transfer data plane: auto|shm|tcp|ucxx|torch_dist (auto: shm on one host, else "
        "the fastest both ends have; ucxx only with CUDA engines or UCX_TLS set)"))
    kv_port: int = field(default=0, metadata=about("KV transfer control port (prefill side)"))
    tls_cert: str | None = field(default=None, metadata=about("PEM certificate; enables TLS"))
    tls_key: str | None = field(default=None, metadata=about("PEM private key"))
    tls_ca: str | None = field(default=None, metadata=about("PEM CA; enables mutual TLS"))
    cluster_token_file: str | None = field(default=None, metadata=about(
        "file holding the cluster token that internal calls must carry (or env "
        "PDMESH_CLUSTER_TOKEN); unset = no internal authentication"))
    redis_password_file: str | None = field(default=None, metadata=about(
        "file holding the Redis ACL password (or env PDMESH_REDIS_PASSWORD)"))
    redis_ca: str | None = field(default=None, metadata=about(
        "PEM CA verifying a rediss:// server"))
    max_message_bytes: int = field(default=DEFAULT_MAX_MESSAGE_BYTES,
                                   metadata=about("gRPC message size limit"))
    log_level: str = field(default="warning", metadata=about("debug|info|warning|error"))
    # 0 by default: several engines often share a host (the URL is in the ready line and the
    # log); deployments set a fixed port (PDMESH_METRICS_PORT) for their scrape config.
    metrics_port: int = field(default=0, metadata=about(
        "Prometheus /metrics port; 0 picks a free one, -1 turns it off"))
    metrics_host: str = field(default="", metadata=about(
        "/metrics bind address; empty = --host"))
    drain_timeout_s: float = field(default=30.0, metadata=about(
        "on SIGTERM: how long in-flight requests may run on before they are cut (seconds)"))
    stall: StallConfig = field(default_factory=StallConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in [-1, 65535], got {self.metrics_port}")
        if not 0 <= self.kv_port <= 65535:
            raise ValueError(f"--kv-port must be in [0, 65535], got {self.kv_port}")
        if self.kv_backend not in KV_BACKENDS:
            raise ValueError(f"--kv-backend must be one of {KV_BACKENDS}, got "
                             f"{self.kv_backend!r}")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--redis-url must start with redis://, rediss:// or unix://, got "
                             f"{self.redis_url!r}")
        if self.heartbeat_ttl_s <= 0:
            raise ValueError(f"--heartbeat-ttl-s must be > 0, got {self.heartbeat_ttl_s}")
        if self.max_message_bytes < 1 << 16:
            raise ValueError(f"--max-message-bytes must be >= 65536, got "
                             f"{self.max_message_bytes}")
        if not 0 <= self.drain_timeout_s <= 3600:
            raise ValueError(f"--drain-timeout-s must be in [0, 3600], got "
                             f"{self.drain_timeout_s}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        self.tls.validate(server=True)
        if self.tls.enabled and self.kv_backend in ("ucxx", "torch_dist"):
            raise ValueError(f"--kv-backend {self.kv_backend} has no TLS; with --tls-* use "
                             "auto, shm or tcp")
        self.cluster_token  # noqa: B018 - reads and validates the token once, at start-up

    @property
    def tls(self) -> TLSConfig:
        return TLSConfig(self.tls_cert, self.tls_key, self.tls_ca)

    @cached_property
    def cluster_token(self) -> ClusterToken | None:
        return load_cluster_token(self.cluster_token_file)

    @property
    def metrics_bind_host(self) -> str:
        return self.metrics_host or self.host

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host


    def kv_backends(self, preferred: tuple[str, ...]) -> tuple[str, ...]:
        """The data planes to offer/accept: the configured one, or `preferred` for auto."""
        return preferred if self.kv_backend == "auto" else (self.kv_backend,)
