"""Router configuration: one dataclass; CLI flags and PDMESH_<FIELD> env vars map onto it.

`parse_router_config(argv)` fills it (defaults < env < flags, see `pdmesh.config.parse_config`)
and `__post_init__` validates it, so a bad value stops the router at start-up with a message
naming the flag.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from pdmesh.auth import ClusterToken, load_cluster_token
from pdmesh.config import parse_config, split_address
from pdmesh.engine.generation_config import check_source
from pdmesh.grpc_common import DEFAULT_MAX_MESSAGE_BYTES, TLSConfig
from pdmesh.router.admission import AdmissionLimits
from pdmesh.router.routing.base import POLICY_NAMES

LOG_LEVELS = ("debug", "info", "warning", "error")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class RouterConfig:
    host: str = field(default="127.0.0.1", metadata=_help("address to listen on"))
    port: int = field(default=0, metadata=_help("port to listen on; 0 picks a free one"))
    model: str = field(
        default="smollm2",
        metadata=_help("model alias or directory; also the served name unless "
                       "--served-model-name is given"),
    )
    served_model_name: str = field(
        default="", metadata=_help("the name clients ask for and the registry namespace (the "
                                   "engines' --served-model-name); empty = --model")
    )
    tokenizer: str | None = field(
        default=None, metadata=_help("model dir/alias to load the tokenizer from; default: model")
    )
    generation_config: str = field(
        default="auto",
        metadata={**_help("sampling defaults for fields a request leaves unset: auto (the "
                          "model's generation_config.json), vllm (none) or a directory"),
                  "choices": ("auto", "vllm", "PATH")},
    )
    chat_template: str | None = field(
        default=None, metadata=_help("a Jinja chat template (file path or the template "
                                     "itself) replacing the tokenizer's")
    )
    tokenizer_pool_size: int = field(
        default=2,
        metadata=_help("threads tokenizing prompts (one is kept for short prompts when >= 2)"),
    )
    redis_url: str | None = field(
        default=None, metadata=_help("cluster index and registry; unset = static addresses only")
    )
    prefill: tuple[str, ...] = field(
        default=(), metadata=_help("static prefill instance addresses, comma-separated")
    )
    decode: tuple[str, ...] = field(
        default=(), metadata=_help("static decode instance addresses, comma-separated")
    )
    routing_policy: str = field(
        default="prefix_aware", metadata=_help(f"one of {', '.join(POLICY_NAMES)}")
    )
    prefix_weight: float = field(
        default=1.0, metadata=_help("cost weight of one uncached prompt block (prefix_aware)")
    )
    local_prefill_threshold: int = field(
        default=256,
        metadata=_help("decode prefills locally when fewer prompt tokens are uncached on it"),
    )
    max_concurrent_requests: int = field(default=64, metadata=_help("admission limit"))
    max_inflight_tokens: int = field(
        default=1_000_000, metadata=_help("admission limit on prompt + max output tokens")
    )
    max_queued_requests: int = field(default=128, metadata=_help("admission queue length"))
    max_queue_wait_s: float = field(default=30.0, metadata=_help("longest admission wait"))
    poll_interval_s: float = field(
        default=0.5, metadata=_help("how often instances' load and the registry are polled")
    )
    failure_threshold: int = field(
        default=2, metadata=_help("failed polls before an instance leaves routing")
    )
    drain_timeout_s: float = field(
        default=30.0, metadata=_help("on SIGTERM: how long running streams may go on before "
                                     "they are cut (seconds)")
    )
    startup_wait_s: float = field(
        default=30.0, metadata=_help("wait this long for a decode instance before serving")
    )
    rpc_timeout_s: float = field(
        default=2.0, metadata=_help("deadline of control calls (GetLoad, GetInfo, ReleaseKV)")
    )
    request_timeout_s: float = field(
        default=600.0, metadata=_help("deadline of a request whose client set none")
    )
    migration_limit: int = field(
        default=3,
        metadata=_help("times one request's broken decode stream may resume on another decode "
                       "instance; 0 = never"),
    )
    tls_cert: str | None = field(default=None, metadata=_help("PEM certificate (server+client)"))
    tls_key: str | None = field(default=None, metadata=_help("PEM private key"))
    tls_ca: str | None = field(
        default=None, metadata=_help("PEM CA: require client certs, verify instances")
    )
    cluster_token_file: str | None = field(default=None, metadata=_help(
        "file holding the cluster token (or env PDMESH_CLUSTER_TOKEN): sent on calls to "
        "engines, required on registry entries, signs KV transfer capabilities"))
    redis_password_file: str | None = field(default=None, metadata=_help(
        "file holding the Redis ACL password (or env PDMESH_REDIS_PASSWORD)"))
    redis_ca: str | None = field(default=None, metadata=_help(
        "PEM CA verifying a rediss:// server"))
    max_message_bytes: int = field(default=DEFAULT_MAX_MESSAGE_BYTES, metadata=_help("gRPC cap"))
    log_level: str = field(default="warning", metadata=_help(f"one of {', '.join(LOG_LEVELS)}"))
    metrics_port: int = field(
        default=9400, metadata=_help("Prometheus /metrics port; 0 picks a free one, -1 = off")
    )
    metrics_host: str = field(default="", metadata=_help("/metrics bind address; empty = --host"))

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in [-1, 65535], got {self.metrics_port}")
        if self.routing_policy not in POLICY_NAMES:
            raise ValueError(
                f"--routing-policy must be one of {', '.join(POLICY_NAMES)}, "
                f"got {self.routing_policy!r}"
            )
        for flag, addresses in (("--prefill", self.prefill), ("--decode", self.decode)):
            for address in addresses:
                try:
                    split_address(address)
                except ValueError as exc:
                    raise ValueError(f"{flag}: {exc}") from None
        if not self.redis_url and not (self.prefill and self.decode):
            raise ValueError("give --redis-url, or both --prefill and --decode addresses")
        if self.prefix_weight < 0:
            raise ValueError(f"--prefix-weight must be >= 0, got {self.prefix_weight}")
        if self.local_prefill_threshold < 0:
            raise ValueError(
                f"--local-prefill-threshold must be >= 0, got {self.local_prefill_threshold}"
            )
        if self.startup_wait_s < 0:
            raise ValueError(f"--startup-wait-s must be >= 0, got {self.startup_wait_s}")
        if not 0 <= self.drain_timeout_s <= 3600:
            raise ValueError(f"--drain-timeout-s must be in [0, 3600], got "
                             f"{self.drain_timeout_s}")
        for name in ("poll_interval_s", "rpc_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if not 1 <= self.tokenizer_pool_size <= 64:
            raise ValueError(
                f"--tokenizer-pool-size must be in [1, 64], got {self.tokenizer_pool_size}"
            )
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if self.failure_threshold < 1:
            raise ValueError(f"--failure-threshold must be >= 1, got {self.failure_threshold}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        check_source(self.generation_config)
        self.tls.validate(server=True)
        self.cluster_token  # noqa: B018 - reads and validates the token once, at start-up
        self.admission_limits()  # validates the admission fields

    @cached_property
    def cluster_token(self) -> ClusterToken | None:
        return load_cluster_token(self.cluster_token_file)

    @property
    def model_name(self) -> str:
        """The served model name: what clients ask for, and the registry namespace."""
        return self.served_model_name or self.model

    @property
    def model_source(self) -> str:
        """Where the tokenizer and generation config are read from."""
        return self.tokenizer or self.model

    @property
    def tls(self) -> TLSConfig:
        return TLSConfig(cert=self.tls_cert, key=self.tls_key, ca=self.tls_ca)

    def admission_limits(self) -> AdmissionLimits:
        try:
            return AdmissionLimits(
                max_concurrent_requests=self.max_concurrent_requests,
                max_inflight_tokens=self.max_inflight_tokens,
                max_queued_requests=self.max_queued_requests,
                max_queue_wait_s=self.max_queue_wait_s,
            )
        except ValueError as exc:
            raise ValueError(f"--{str(exc).replace('_', '-')}") from None


def parse_router_config(
    argv: Sequence[str] | None, env: Mapping[str, str] | None = None
) -> RouterConfig:
    return parse_config(
        RouterConfig, argv, prog="pdmesh router",
        description="pdmesh router: admission, prefix-aware routing, prefill -> decode",
        env=env,
    )
