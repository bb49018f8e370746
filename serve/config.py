"""`pdmesh serve`'s settings: the mesh's shape, every engine setting, and those of the router's,
the gateway's and the engine services' settings that it offers.

Nothing here is restated: the engine's settings are `EngineConfig` itself (embedded), and a
setting offered from a child's config takes its default and help from there (`field_like`).
Each child gets the settings its own config declares, by name (serve/child_config.py); a
setting that none of them would accept is refused here, at start-up, naming its flag.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdmesh.config import about, field_like, name_flag
from pdmesh.engine.config import EngineConfig
from pdmesh.engine_svc.config import EngineServiceConfig
from pdmesh.gateway.config import GatewayConfig
from pdmesh.router.config import RouterConfig
from pdmesh.serve.child_config import check_children


@dataclass
class MeshConfig:
    """`pdmesh serve`'s flags: vLLM's names and meanings where vLLM has the knob (`--port` is
    the OpenAI HTTP port, the model is positional), pdmesh's own for the mesh's shape."""

    # The mesh's own: the model and KV budget of every engine (a smaller default budget than
    # one engine alone: several share this host or GPU, serve/child_config.py's
    # `engine_memory`); `engine` takes them over.
    model: str = field(default="smollm2", metadata=about(
        "model alias, HF-format directory or Hugging Face Hub id (also positional: pdmesh "
        "serve MODEL)"))
    kv_cache_memory: int | float | str = field(default="auto", metadata=about(
        "KV budget per engine: bytes, e.g. 2GiB, or a fraction of free memory, e.g. 0.5; "
        "auto = 512MiB on CPU, on CUDA a profiled share of the GPU per engine: "
        "--gpu-memory-utilization each when given, else 0.9 divided among the engines",
        aliases=("--kv-cache-memory-bytes",)))
    served_model_name: str = field(default="", metadata=about(
        "the name clients ask for (/v1/models id); empty = the model argument. Several, as "
        "vLLM takes them (--served-model-name a b): the first is the name, the rest "
        "--served-model-aliases"))
    served_model_aliases: tuple[str, ...] = field_like(RouterConfig, "served_model_aliases")
    num_prefill: int = field(default=1, metadata=about("prefill processes"))
    num_decode: int = field(default=1, metadata=about("decode processes"))
    prefill_tensor_parallel_size: int = field(default=0, metadata=about(
        "ranks of each prefill engine, when they differ from the decode engines' (P/D "
        "between tensor-parallel sizes); 0 = --tensor-parallel-size"))
    decode_tensor_parallel_size: int = field(default=0, metadata=about(
        "ranks of each decode (or colocated) engine; 0 = --tensor-parallel-size"))
    colocated: bool = field(default=False, metadata=about(
        "engines do prefill and decode themselves (no KV moves); --num-decode of them, no "
        "prefill processes"))
    host: str = field(default="127.0.0.1", metadata=about("address every service binds"))
    port: int = field(default=8000, metadata=about(
        "OpenAI HTTP API port; 0 picks a free one, -1 runs no HTTP gateway"))
    grpc_port: int = field(default=0, metadata=about(
        "router gRPC port (formerly --port); 0 picks a free one"))
    gateway_port: int | None = field(default=None, metadata=about(
        "deprecated alias of --port"))
    redis_url: str | None = field(default=None, metadata=about(
        "use this Redis instead of starting one"))
    tls_cert: str | None = field(default=None, metadata=about("PEM cert for every hop"))
    tls_key: str | None = field(default=None, metadata=about("PEM private key"))
    tls_ca: str | None = field(default=None, metadata=about("PEM CA: mutual TLS everywhere"))
    api_key: str | None = field(default=None, metadata=about(
        "require 'Authorization: Bearer <key>' on /v1/* (better: env PDMESH_API_KEY); "
        "several keys: comma-separated, or --api-key KEY1 KEY2 as vLLM takes them"))
    startup_timeout_s: float = field(default=180.0, metadata=about("per-child ready deadline"))
    drain_timeout_s: float | None = field(default=None, metadata=about(
        "on SIGTERM: how long every child may finish running requests before they are cut "
        "(unset: theirs, 30 s; 0: at once); pdmesh serve waits that long (plus their "
        "teardown) before it kills one", aliases=("--shutdown-timeout",)))
    log_level: str = field(default="warning", metadata=about("children's log level"))

    # Every engine setting (--max-num-seqs, --dtype, --stream-interval, ...), for every engine.
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv_backend: str = field_like(EngineServiceConfig, "kv_backend")

    # The router's.
    routing_policy: str = field_like(RouterConfig, "routing_policy")
    local_prefill_threshold: int = field_like(RouterConfig, "local_prefill_threshold")
    kv_stream_chunks: bool = field_like(RouterConfig, "kv_stream_chunks")
    max_queue_delay_s: float = field_like(RouterConfig, "max_queue_delay_s")
    goodput: tuple[str, ...] = field_like(RouterConfig, "goodput")
    generation_config: str = field_like(RouterConfig, "generation_config")
    enable_log_requests: bool = field_like(RouterConfig, "enable_log_requests")
    enable_log_outputs: bool = field_like(RouterConfig, "enable_log_outputs")
    max_log_len: int | None = field_like(RouterConfig, "max_log_len")
    override_generation_config: str = field_like(RouterConfig, "override_generation_config")
    default_chat_template_kwargs: str = field_like(RouterConfig,
                                                   "default_chat_template_kwargs")
    chat_template: str | None = field_like(RouterConfig, "chat_template")

    # The gateway's.
    enable_auto_tool_choice: bool = field_like(GatewayConfig, "enable_auto_tool_choice")
    tool_call_parser: str | None = field_like(GatewayConfig, "tool_call_parser")
    reasoning_parser: str | None = field_like(GatewayConfig, "reasoning_parser")
    exclude_tools_when_tool_choice_none: bool = field_like(
        GatewayConfig, "exclude_tools_when_tool_choice_none")
    disable_fastapi_docs: bool = field_like(GatewayConfig, "disable_fastapi_docs")
    sse_keep_alive_interval: float = field_like(GatewayConfig, "sse_keep_alive_interval")
    return_tokens_as_token_ids: bool = field_like(GatewayConfig, "return_tokens_as_token_ids")
    enable_force_include_usage: bool = field_like(GatewayConfig, "enable_force_include_usage")
    root_path: str = field_like(GatewayConfig, "root_path")
    allowed_origins: tuple[str, ...] = field_like(GatewayConfig, "allowed_origins")
    allowed_methods: tuple[str, ...] = field_like(GatewayConfig, "allowed_methods")
    allowed_headers: tuple[str, ...] = field_like(GatewayConfig, "allowed_headers")
    allow_credentials: bool = field_like(GatewayConfig, "allow_credentials")
    ssl_certfile: str | None = field_like(GatewayConfig, "ssl_certfile")
    ssl_keyfile: str | None = field_like(GatewayConfig, "ssl_keyfile")
    ssl_ca_certs: str | None = field_like(GatewayConfig, "ssl_ca_certs")
    ssl_cert_reqs: int = field_like(GatewayConfig, "ssl_cert_reqs")
    ssl_ciphers: str | None = field_like(GatewayConfig, "ssl_ciphers")
    uvicorn_log_level: str | None = field_like(GatewayConfig, "uvicorn_log_level")
    max_logprobs: int = field_like(GatewayConfig, "max_logprobs")
    metrics_names: str = field_like(GatewayConfig, "metrics_names")

    # vLLM's, accepted only where pdmesh behaves so (serve/vllm_flags.py: those refused).
    trust_remote_code: bool = field(default=False, metadata=about(
        "vLLM's flag; pdmesh runs its own model code, so only false is accepted"))
    # vLLM's, carried to every child in its environment (never on a command line).
    otlp_traces_endpoint: str | None = field(default=None, metadata=about(
        "where every process sends its OpenTelemetry traces (vLLM's flag; sets "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT for the children)"))
    hf_token: str | None = field(default=None, metadata=about(
        "the Hugging Face token for gated models (vLLM's flag; sets HF_TOKEN for the children; "
        "better: set HF_TOKEN, a flag shows in ps)"))

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("--num-decode must be >= 1 and --num-prefill >= 0")
        if self.colocated:
            self.num_prefill = 0
        if self.gateway_port is not None:
            self.port = self.gateway_port
            self.gateway_port = None
        if not -1 <= self.port <= 65535:
            raise ValueError("--port must be -1 (no HTTP API), 0 (a free port) or a port")
        if not 0 <= self.grpc_port <= 65535:
            raise ValueError("--grpc-port must be 0 (a free port) or a port")
        if self.startup_timeout_s <= 0:
            raise ValueError("--startup-timeout-s must be > 0")
        for name in ("prefill_tensor_parallel_size", "decode_tensor_parallel_size"):
            if not 0 <= getattr(self, name) <= 1024:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1024]")
        if self.trust_remote_code:
            raise ValueError("--trust-remote-code is not supported yet: pdmesh runs its own "
                             "model code (Llama-family architectures)")
        if self.drain_timeout_s is not None and not 0 <= self.drain_timeout_s <= 3600:
            raise ValueError(f"--drain-timeout-s must be in [0, 3600], got {self.drain_timeout_s}")
        try:
            self.engine = dataclasses.replace(self.engine, model=self.model,
                                              kv_cache_memory=self.kv_cache_memory)
        except ValueError as exc:
            raise ValueError(name_flag(str(exc), EngineConfig)) from None
        check_children(self)

    def tensor_parallel_size(self, kind: str) -> int:
        """The ranks of an engine of `kind` (prefill, decode or colocated)."""
        own = (self.prefill_tensor_parallel_size if kind == "prefill"
               else self.decode_tensor_parallel_size)
        return own or self.engine.tensor_parallel_size

    @property
    def http_port(self) -> int:
        """The OpenAI HTTP port (-1: no gateway). `gateway_port` is folded into `port`."""
        return self.port
