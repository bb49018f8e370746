"""Router configuration: one dataclass; CLI flags and PDMESH_<FIELD> env vars map onto it.

`parse_router_config(argv)` fills it (defaults < env < flags, see `pdmesh.config.parse_config`)
and `__post_init__` validates it, so a bad value stops the router at start-up with a message
naming the flag.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from pdmesh.auth import ClusterToken, load_cluster_token
from pdmesh.config import about, parse_config, split_address
from pdmesh.engine.chat_template import parse_template_defaults, template_defaults_field
from pdmesh.engine.frontend.stall import StallConfig
from pdmesh.engine.generation_config import check_source, parse_override
from pdmesh.engine.structured_output import DEFAULT_COMPILE_TIMEOUT_S
from pdmesh.grpc_common import DEFAULT_MAX_MESSAGE_BYTES, TLSConfig
from pdmesh.router.admission import AdmissionLimits
from pdmesh.router.routing.base import POLICY_NAMES
from pdmesh.slo import parse_goodput

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class RouterConfig:
    host: str = field(default="127.0.0.1", metadata=about("address to listen on"))
    port: int = field(default=0, metadata=about("port to listen on; 0 picks a free one"))
    model: str = field(
        default="smollm2",
        metadata=about("model alias, directory or Hub id; also the served name unless "
                       "--served-model-name is given"),
    )
    served_model_name: str = field(
        default="", metadata=about("the name clients ask for and the registry namespace (the "
                                   "engines' --served-model-name); empty = --model")
    )
    served_model_aliases: tuple[str, ...] = field(default=(), metadata=about(
        "more names clients may ask for the model by, comma-separated (vLLM's "
        "--served-model-name takes several: pdmesh serve makes the rest of them these)"))
    tokenizer: str | None = field(
        default=None, metadata=about("model dir/alias to load the tokenizer from; default: model")
    )
    revision: str | None = field(
        default=None, metadata=about("the Hub model's branch, tag or commit (vLLM's flag; the "
                                     "engines' --revision); unset = main")
    )
    tokenizer_revision: str | None = field(
        default=None, metadata=about("the Hub tokenizer's branch, tag or commit (vLLM's flag; "
                                     "the engines' --tokenizer-revision)")
    )
    download_dir: str | None = field(
        default=None, metadata=about("where Hub models are looked up and downloaded (the "
                                     "engines' --download-dir); unset = the Hugging Face cache")
    )
    generation_config: str = field(
        default="auto",
        metadata=about("sampling defaults for fields a request leaves unset: auto (the "
                         "model's generation_config.json), vllm (none) or a directory",
                         ("auto", "vllm", "PATH")),
    )
    override_generation_config: str = field(
        default="", metadata=about("a JSON object merged over --generation-config's sampling "
                                   "defaults, in generation_config.json's names (vLLM's "
                                   "flag), e.g. '{\"temperature\": 0.5, \"max_new_tokens\": "
                                   "256}'"))
    default_chat_template_kwargs: str = template_defaults_field()
    chat_template: str | None = field(
        default=None, metadata=about("a Jinja chat template replacing the tokenizer's: a "
                                     "file, the template itself, or a tool-calling template "
                                     "shipped with pdmesh by name (hermes, llama3_json)")
    )
    tokenizer_pool_size: int = field(
        default=2,
        metadata=about("threads tokenizing prompts (one is kept for short prompts when >= 2)"),
    )
    redis_url: str | None = field(
        default=None, metadata=about("cluster index and registry; unset = static addresses only")
    )
    prefill: tuple[str, ...] = field(
        default=(), metadata=about("static prefill instance addresses, comma-separated")
    )
    decode: tuple[str, ...] = field(
        default=(), metadata=about("static decode instance addresses, comma-separated")
    )
    routing_policy: str = field(
        default="prefix_aware", metadata=about(f"one of {', '.join(POLICY_NAMES)}")
    )
    prefix_weight: float = field(
        default=1.0, metadata=about("cost weight of one uncached prompt block (prefix_aware)")
    )
    local_prefill_threshold: int = field(
        default=256,
        metadata=about("decode prefills locally when fewer prompt tokens are uncached on it"),
    )
    max_concurrent_requests: int = field(default=64, metadata=about("admission limit"))
    max_inflight_tokens: int = field(
        default=1_000_000, metadata=about("admission limit on prompt + max output tokens")
    )
    max_queued_requests: int = field(default=128, metadata=about("admission queue length"))
    max_queue_wait_s: float = field(default=30.0, metadata=about("longest admission wait"))
    max_queue_delay_s: float = field(default=60.0, metadata=about(
        "refuse a request (429 with Retry-After) when its predicted time to first token, from "
        "the prompt tokens queued ahead of it and the instances' measured prefill speed, is "
        "longer than this (seconds); 0 = never"))
    poll_interval_s: float = field(
        default=0.5, metadata=about("how often instances' load and the registry are polled")
    )
    failure_threshold: int = field(
        default=2, metadata=about("failed polls before an instance leaves routing")
    )
    drain_timeout_s: float = field(
        default=30.0, metadata=about("on SIGTERM: how long running streams may go on before "
                                     "they are cut (seconds)")
    )
    startup_wait_s: float = field(
        default=30.0, metadata=about("wait this long for a decode instance before serving")
    )
    rpc_timeout_s: float = field(
        default=2.0, metadata=about("deadline of control calls (GetLoad, GetInfo, ReleaseKV)")
    )
    request_timeout_s: float = field(
        default=600.0, metadata=about("deadline of a request whose client set none")
    )
    structured_output_compile_timeout_s: float = field(
        default=DEFAULT_COMPILE_TIMEOUT_S, metadata=about(
            "a structured-output spec must compile within this many seconds (tried in a "
            "process that is killed when it passes) or the request is refused with a 400; "
            "the engines keep their own bound")
    )
    migration_limit: int = field(
        default=3,
        metadata=about("times one request's broken decode stream may resume on another decode "
                       "instance; 0 = never"),
    )
    kv_stream_chunks: bool = field(
        default=True,
        metadata=about("P/D: ask prefill instances for PrefillStream and start Decode at the "
                       "first message, so the decode instance pulls each prefill chunk's KV "
                       "blocks while the next chunk computes (--no-kv-stream-chunks: Prefill, "
                       "then Decode, as before)"),
    )
    kv_peer_reuse: bool = field(
        default=True,
        metadata=about("cluster-wide prefix caching: when another live instance holds more of "
                       "a prompt's leading blocks than the instance computing it, that instance "
                       "pulls them from the holder instead of computing them, when the cost "
                       "model (router/routing/README.md) says the move is faster "
                       "(--no-kv-peer-reuse: compute them)"),
    )
    kv_peer_reuse_min_tokens: int = field(
        default=32,
        metadata=about("peer reuse only when the holder has at least this many prompt tokens "
                       "more than the instance computing the prompt"),
    )
    stall: StallConfig = field(default_factory=StallConfig)
    goodput: tuple[str, ...] = field(default=(), metadata=about(
        "SLOs a finished request must meet to count in pdmesh:router_goodput_requests, as "
        "vLLM's bench client takes them, comma-separated: ttft:MS,tpot:MS,e2el:MS,itl:MS "
        "(itl: the longest gap between two deltas)"))
    tls_cert: str | None = field(default=None, metadata=about("PEM certificate (server+client)"))
    tls_key: str | None = field(default=None, metadata=about("PEM private key"))
    tls_ca: str | None = field(
        default=None, metadata=about("PEM CA: require client certs, verify instances")
    )
    cluster_token_file: str | None = field(default=None, metadata=about(
        "file holding the cluster token (or env PDMESH_CLUSTER_TOKEN): sent on calls to "
        "engines, required on registry entries, signs KV transfer capabilities"))
    redis_password_file: str | None = field(default=None, metadata=about(
        "file holding the Redis ACL password (or env PDMESH_REDIS_PASSWORD)"))
    redis_ca: str | None = field(default=None, metadata=about(
        "PEM CA verifying a rediss:// server"))
    max_message_bytes: int = field(default=DEFAULT_MAX_MESSAGE_BYTES, metadata=about("gRPC cap"))
    log_level: str = field(default="warning", metadata=about(f"one of {', '.join(LOG_LEVELS)}"))
    enable_log_requests: bool = field(default=False, metadata=about(
        "log each request as it is admitted: its id, prompt length and sampling (logger "
        "pdmesh.requests at INFO, whatever --log-level; the prompt's ids at DEBUG)"))
    enable_log_outputs: bool = field(default=False, metadata=about(
        "with --enable-log-requests: also log each output sequence as it ends, its text and "
        "finish reason"))
    max_log_len: int | None = field(default=None, metadata=about(
        "the most characters of a text, or token ids, a request log line shows (unset: all)"))
    metrics_port: int = field(
        default=9400, metadata=about("Prometheus /metrics port; 0 picks a free one, -1 = off")
    )
    metrics_host: str = field(default="", metadata=about("/metrics bind address; empty = --host"))

    def __post_init__(self) -> None:
        parse_goodput(self.goodput)  # raises naming the SLO it cannot read
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
        if self.kv_peer_reuse_min_tokens < 1:
            raise ValueError(f"--kv-peer-reuse-min-tokens must be >= 1, got "
                             f"{self.kv_peer_reuse_min_tokens}")
        if self.local_prefill_threshold < 0:
            raise ValueError(
                f"--local-prefill-threshold must be >= 0, got {self.local_prefill_threshold}"
            )
        if self.max_queue_delay_s < 0:
            raise ValueError(f"--max-queue-delay-s must be >= 0, got {self.max_queue_delay_s}")
        if self.startup_wait_s < 0:
            raise ValueError(f"--startup-wait-s must be >= 0, got {self.startup_wait_s}")
        if not 0 <= self.drain_timeout_s <= 3600:
            raise ValueError(f"--drain-timeout-s must be in [0, 3600], got "
                             f"{self.drain_timeout_s}")
        for name in ("poll_interval_s", "rpc_timeout_s", "request_timeout_s",
                     "structured_output_compile_timeout_s"):
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
        if self.enable_log_outputs and not self.enable_log_requests:
            raise ValueError("--enable-log-outputs needs --enable-log-requests")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {self.max_log_len}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        check_source(self.generation_config)
        parse_override(self.override_generation_config)
        self.template_defaults  # noqa: B018 - validates --default-chat-template-kwargs
        self.tls.validate(server=True)
        self.cluster_token  # noqa: B018 - reads and validates the token once, at start-up
        self.admission_limits()  # validates the admission fields

    @cached_property
    def cluster_token(self) -> ClusterToken | None:
        return load_cluster_token(self.cluster_token_file)

    @cached_property
    def template_defaults(self) -> dict[str, Any]:
        """`--default-chat-template-kwargs`, parsed once (ValueError naming the flag)."""
        return parse_template_defaults(self.default_chat_template_kwargs)

    @property
    def model_name(self) -> str:
        """The served model name: what clients ask for, and the registry namespace."""
        return self.served_model_name or self.model

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name clients may ask for the model by, its own first."""
        return (self.model_name, *(a for a in self.served_model_aliases
                                   if a != self.model_name))

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
