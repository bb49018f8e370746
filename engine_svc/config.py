"""Configuration every engine process shares, whatever its role, validated at start-up.

`EngineServiceConfig` holds what every engine process needs (model, KV budget, addresses,
Redis, TLS, transfer backend); `PrefillConfig` (prefill_svc/config.py) and `DecodeConfig`
(decode_svc/config.py) add their role's knobs. Values come from defaults < PDMESH_<FIELD> env
vars < CLI flags (`pdmesh.config.parse_config`); every error names the flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from pdmesh.auth import ClusterToken, load_cluster_token
from pdmesh.engine.config import EngineConfig
from pdmesh.grpc_common import DEFAULT_MAX_MESSAGE_BYTES, TLSConfig
from pdmesh.kvstore.transfer.handle import BACKEND_NAMES

KV_BACKENDS = ("auto", *BACKEND_NAMES)
LOG_LEVELS = ("debug", "info", "warning", "error")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class EngineServiceConfig:
    model: str = field(default="smollm2", metadata=_help("model alias, HF id or local path"))
    served_model_name: str = field(default="", metadata=_help("name in the registry; "
                                                              "empty = --model"))
    host: str = field(default="127.0.0.1", metadata=_help("gRPC bind address"))
    port: int = field(default=0, metadata=_help("gRPC port; 0 picks a free one"))
    advertise_host: str = field(default="", metadata=_help("address others dial; "
                                                           "empty = --host"))
    redis_url: str = field(default="", metadata=_help("redis://host:port/db of the cluster "
                                                      "index; empty = run without Redis"))
    heartbeat_ttl_s: float = field(default=10.0, metadata=_help("registration TTL (seconds)"))
    kv_backend: str = field(default="auto", metadata=_help("KV transfer data plane: "
                                                           "auto|shm|tcp|ucxx|torch_dist"))
    kv_port: int = field(default=0, metadata=_help("KV transfer control port (prefill side)"))
    tls_cert: str | None = field(default=None, metadata=_help("PEM certificate; enables TLS"))
    tls_key: str | None = field(default=None, metadata=_help("PEM private key"))
    tls_ca: str | None = field(default=None, metadata=_help("PEM CA; enables mutual TLS"))
    cluster_token_file: str | None = field(default=None, metadata=_help(
        "file holding the cluster token that internal calls must carry (or env "
        "PDMESH_CLUSTER_TOKEN); unset = no internal authentication"))
    redis_password_file: str | None = field(default=None, metadata=_help(
        "file holding the Redis ACL password (or env PDMESH_REDIS_PASSWORD)"))
    redis_ca: str | None = field(default=None, metadata=_help(
        "PEM CA verifying a rediss:// server"))
    max_message_bytes: int = field(default=DEFAULT_MAX_MESSAGE_BYTES,
                                   metadata=_help("gRPC message size limit"))
    kv_cache_memory: str = field(default="1GiB", metadata=_help("KV cache budget, e.g. 2GiB "
                                                                "or 0.2 (fraction)"))
    block_size: int = field(default=16, metadata=_help("tokens per KV block"))
    max_num_seqs: int = field(default=256, metadata=_help("max sequences per batch"))
    max_num_batched_tokens: int = field(default=2048, metadata=_help("token budget per step"))
    max_model_len: int | None = field(default=None, metadata=_help("context limit (tokens)"))
    device: str = field(default="auto", metadata=_help("auto|cpu|cuda[:N]"))
    dtype: str = field(default="auto", metadata=_help("auto|float32|bfloat16|float16"))
    attention_backend: str = field(
        default="auto", metadata=_help("auto|flash-attn|triton|cpu|torch (auto picks by device)")
    )
    seed: int = field(default=0, metadata=_help("engine seed (unseeded requests)"))
    enable_prefix_caching: bool = field(default=True, metadata=_help(
        "reuse the KV of shared prompt prefixes (vLLM's flag)"))
    gpu_memory_utilization: float | None = field(default=None, metadata=_help(
        "CUDA: fraction of GPU memory this engine may use, weights included; the KV cache "
        "gets the rest (replaces --kv-cache-memory)"))
    enforce_eager: bool = field(default=False, metadata=_help(
        "never capture CUDA graphs for decode steps (vLLM's flag; no effect on CPU)"))
    async_scheduling: bool | None = field(default=None, metadata=_help(
        "launch each step before the previous one's sampled tokens reach the host (vLLM's "
        "flag); unset: on for CUDA, off on CPU"))
    load_format: str = field(default="auto", metadata=_help(
        "auto: the checkpoint's safetensors; dummy: random weights of the model's shape "
        "(benchmarks)"))
    engine_core_process: bool = field(default=True, metadata=_help(
        "run the engine core (scheduler, KV cache, model) in its own process, away from "
        "the gRPC server's GIL"))
    cpu_threads: int | None = field(default=None, metadata=_help(
        "torch threads of the engine core; default: every usable CPU on a CPU device, 1 on "
        "CUDA (or OMP_NUM_THREADS when set)"))
    stream_interval: int = field(default=1, metadata=_help(
        "stream a request's output once this many new tokens are pending (the first and the "
        "last at once; vLLM's flag): fewer, larger messages on every hop for a little "
        "burstiness; a request's own stream_interval may raise it"))
    hash_algorithm: str = field(default="sha256", metadata=_help("block hash algorithm"))
    hash_root_seed: str = field(default="pdmesh", metadata=_help("block hash chain root"))
    log_level: str = field(default="warning", metadata=_help("debug|info|warning|error"))
    # 0 by default: several engines often share a host (the URL is in the ready line and the
    # log); deployments set a fixed port (PDMESH_METRICS_PORT) for their scrape config.
    metrics_port: int = field(default=0, metadata=_help("Prometheus /metrics port; 0 picks "
                                                        "a free one, -1 turns it off"))
    metrics_host: str = field(default="", metadata=_help("/metrics bind address; "
                                                         "empty = --host"))
    drain_timeout_s: float = field(default=30.0, metadata=_help(
        "on SIGTERM: how long in-flight requests may run on before they are cut (seconds)"))

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
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        self.cluster_token  # noqa: B018 - reads and validates the token once, at start-up
        self.engine_config()  # EngineConfig validates the engine's own fields

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
        return self.served_model_name or self.model

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            kv_cache_memory=self.kv_cache_memory,
            dtype=self.dtype,
            device=self.device,
            attention_backend=self.attention_backend,
            seed=self.seed,
            enable_prefix_caching=self.enable_prefix_caching,
            gpu_memory_utilization=self.gpu_memory_utilization,
            hash_algorithm=self.hash_algorithm,
            hash_root_seed=self.hash_root_seed,
            enforce_eager=self.enforce_eager,
            async_scheduling=self.async_scheduling,
            load_format=self.load_format,  # type: ignore[arg-type]
            engine_core_process=self.engine_core_process,
            cpu_threads=self.cpu_threads,
            stream_interval=self.stream_interval,
        )

    def kv_backends(self, preferred: tuple[str, ...]) -> tuple[str, ...]:
        """The data planes to offer/accept: the configured one, or `preferred` for auto."""
        return preferred if self.kv_backend == "auto" else (self.kv_backend,)
