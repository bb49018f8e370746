"""Gateway configuration: one dataclass; CLI flags and PDMESH_<FIELD> env vars map onto it.

`parse_gateway_config(argv)` fills it (defaults < env < flags, see `pdmesh.config.parse_config`);
`__post_init__` validates it so a bad value stops the gateway at start-up naming the flag.
The API key is best given as PDMESH_API_KEY: a flag shows up in `ps` output.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from pdmesh.config import about, parse_config, split_address
from pdmesh.engine.chat_template import parse_template_defaults, template_defaults_field
from pdmesh.engine.sampling_params import MAX_LOGPROBS
from pdmesh.gateway.answer_settings import AnswerSettings
from pdmesh.gateway.metrics_federation import MetricsTarget, parse_targets
from pdmesh.gateway.reasoning_parsers import REASONING_PARSERS, check_reasoning_parser
from pdmesh.gateway.reply import ReasoningSettings
from pdmesh.gateway.tool_parsers import TOOL_PARSERS, check_tool_flags
from pdmesh.gateway.tools import ToolSettings
from pdmesh.grpc_common import DEFAULT_MAX_MESSAGE_BYTES, TLSConfig
from pdmesh.metrics_vllm import METRICS_NAMES, metrics_names

LOG_LEVELS = ("debug", "info", "warning", "error")
UVICORN_LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "critical")


@dataclass
class GatewayConfig:
    router_address: str = field(
        default="127.0.0.1:50051", metadata=about("host:port of the pdmesh router (gRPC)")
    )
    host: str = field(default="127.0.0.1", metadata=about("HTTP address to listen on"))
    port: int = field(default=8000, metadata=about("HTTP port; 0 picks a free one"))
    api_key: str | None = field(
        default=None, metadata=about("require 'Authorization: Bearer <key>' on /v1/*; several "
                                     "keys (any one is accepted): comma-separated, or vLLM's "
                                     "--api-key KEY1 KEY2 on pdmesh serve")
    )
    allowed_origins: tuple[str, ...] = field(
        default=(), metadata=about("CORS: origins browsers may call from, comma-separated or a "
                                   "JSON list (vLLM's form); * = any; empty = no CORS headers")
    )
    allowed_methods: tuple[str, ...] = field(default=("*",),
                                             metadata=about("CORS: allowed methods"))
    allowed_headers: tuple[str, ...] = field(default=("*",),
                                             metadata=about("CORS: allowed request headers"))
    allow_credentials: bool = field(default=False, metadata=about("CORS: allow credentials"))
    request_timeout_s: float = field(
        default=600.0, metadata=about("gRPC deadline of one generation request")
    )
    control_timeout_s: float = field(
        default=5.0, metadata=about("gRPC deadline of ListModels, Tokenize and health checks")
    )
    drain_timeout_s: float = field(
        default=30.0, metadata=about("on SIGTERM: how long running responses may go on before "
                                     "they are cut (seconds)")
    )
    max_request_bytes: int = field(
        default=16 * 2**20, metadata=about("largest accepted HTTP request body")
    )
    keep_alive_timeout_s: float = field(default=5.0, metadata=about(
        "close a kept-alive HTTP connection idle this long between requests (uvicorn's "
        "--timeout-keep-alive)"))
    header_timeout_s: float = field(default=10.0, metadata=about(
        "close a connection whose request line and headers have not all arrived this long "
        "after it opened (or after its next request began): slow clients, slowloris"))
    tls_cert: str | None = field(
        default=None, metadata=about("PEM client certificate for the router hop (mutual TLS)")
    )
    tls_key: str | None = field(default=None, metadata=about("PEM private key for --tls-cert"))
    tls_ca: str | None = field(default=None, metadata=about("PEM CA that signed the router's cert"))
    ssl_certfile: str | None = field(default=None, metadata=about(
        "PEM certificate: serve HTTPS (vLLM's flag)"))
    ssl_keyfile: str | None = field(default=None, metadata=about("PEM private key for HTTPS"))
    ssl_ca_certs: str | None = field(default=None, metadata=about(
        "PEM CA verifying HTTPS client certificates (with --ssl-cert-reqs 2: required)"))
    ssl_cert_reqs: int = field(default=0, metadata=about(
        "HTTPS client certificates: 0 none, 1 optional, 2 required (Python ssl's values)"))
    ssl_ciphers: str | None = field(default=None, metadata=about(
        "HTTPS: the OpenSSL cipher list the server offers (vLLM's flag; unset: uvicorn's)"))
    enable_auto_tool_choice: bool = field(default=False, metadata=about(
        'tool_choice "auto" (the default with tools): parse tool calls out of the model\'s '
        "output with --tool-call-parser"))
    tool_call_parser: str | None = field(default=None, metadata=about(
        "how the model writes tool calls (for --enable-auto-tool-choice)", tuple(TOOL_PARSERS)))
    reasoning_parser: str | None = field(default=None, metadata=about(
        "split a thinking model's reasoning out of its content into the `reasoning` field "
        "(vLLM's flag)", tuple(REASONING_PARSERS)))
    default_chat_template_kwargs: str = template_defaults_field()
    exclude_tools_when_tool_choice_none: bool = field(default=False, metadata=about(
        'tool_choice "none": leave the tools out of the prompt (default: the template gets '
        "them, as in vLLM)"))
    return_tokens_as_token_ids: bool = field(default=False, metadata=about(
        "logprob tokens read token_id:<id> in every answer, whatever the request says "
        "(vLLM's flag)"))
    enable_force_include_usage: bool = field(default=False, metadata=about(
        "every stream ends with a usage chunk, stream_options or not (vLLM's flag)"))
    sse_keep_alive_interval: float = field(default=0.0, metadata=about(
        "streams: an SSE comment after this many seconds without output (queue waits, long "
        "prefills), so proxies that close idle connections do not; the stream then starts "
        "when the router accepts the request (vLLM's flag; 0 = off)"))
    disable_fastapi_docs: bool = field(default=False, metadata=about(
        "serve no /docs, /redoc or /openapi.json (vLLM's flag)"))
    root_path: str = field(default="", metadata=about(
        "the path prefix a proxy serves this API under, for the links it makes (vLLM's flag; "
        "uvicorn's root_path)"))
    model_root: str | None = field(default=None, metadata=about(
        "the model behind the served name, reported as /v1/models' `root` (as vLLM reports "
        "its model path); unset = the served name"))
    max_message_bytes: int = field(default=DEFAULT_MAX_MESSAGE_BYTES, metadata=about("gRPC cap"))
    log_level: str = field(default="warning", metadata=about(f"one of {', '.join(LOG_LEVELS)}"))
    uvicorn_log_level: str | None = field(default=None, metadata=about(
        "uvicorn's own log level (vLLM's flag); unset = --log-level", UVICORN_LOG_LEVELS))
    max_logprobs: int = field(default=MAX_LOGPROBS, metadata=about(
        "the most logprobs a request may ask for (logprobs, top_logprobs, prompt_logprobs; "
        f"vLLM's flag); at most {MAX_LOGPROBS}, what the engines return"))
    metrics_names: str = field(default="pdmesh", metadata=about(
        "metric names on /metrics: pdmesh (pdmesh:* only) or vllm (also vLLM's vllm:* names "
        "for the quantities pdmesh measures, for vLLM's dashboards)", METRICS_NAMES))
    metrics_federate: tuple[str, ...] = field(default=(), metadata=about(
        "other processes' /metrics to serve on this /metrics too, as name=url (or "
        "name=host:port), comma-separated; each series gets service=<name>. pdmesh serve "
        "sets it; empty = only the gateway's own"))
    metrics_federate_timeout_s: float = field(default=2.0, metadata=about(
        "how long /metrics waits for each --metrics-federate process (one missing is "
        "reported as pdmesh:metrics_scrape_up 0)"))

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            setattr(self, name, _cors_list(f"--{name.replace('_', '-')}", getattr(self, name)))
        try:
            split_address(self.router_address)
        except ValueError as exc:
            raise ValueError(f"--router-address: {exc}") from None
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not all(k.strip() for k in self.api_key.split(",")):
            raise ValueError("--api-key must not be blank, nor hold a blank key between its "
                             "commas (leave it unset to disable auth)")
        for name in ("request_timeout_s", "control_timeout_s", "keep_alive_timeout_s",
                     "header_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if not 0 <= self.drain_timeout_s <= 3600:
            raise ValueError(f"--drain-timeout-s must be in [0, 3600], got {self.drain_timeout_s}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        if self.uvicorn_log_level is not None and self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(
                f"--uvicorn-log-level must be one of {', '.join(UVICORN_LOG_LEVELS)}")
        if not 0 <= self.sse_keep_alive_interval <= 3600:
            raise ValueError("--sse-keep-alive-interval must be in [0, 3600] seconds, got "
                             f"{self.sse_keep_alive_interval}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}], got "
                             f"{self.max_logprobs}")
        self.metrics_names = metrics_names(self.metrics_names)
        self.federate_targets  # noqa: B018 - parses and validates the targets at start-up
        if not 0 < self.metrics_federate_timeout_s <= 60:
            raise ValueError("--metrics-federate-timeout-s must be in (0, 60], got "
                             f"{self.metrics_federate_timeout_s}")
        self.tls.validate(server=False)
        self._validate_https()
        check_tool_flags(self.enable_auto_tool_choice, self.tool_call_parser)
        check_reasoning_parser(self.reasoning_parser)
        self.reasoning_settings  # noqa: B018 - parses --default-chat-template-kwargs

    def _validate_https(self) -> None:
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("--ssl-certfile and --ssl-keyfile must be given together")
        if (self.ssl_ca_certs or self.ssl_cert_reqs) and not self.ssl_certfile:
            raise ValueError("--ssl-ca-certs/--ssl-cert-reqs need --ssl-certfile/--ssl-keyfile")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {self.ssl_cert_reqs}")
        if self.ssl_cert_reqs and not self.ssl_ca_certs:
            raise ValueError("--ssl-cert-reqs needs --ssl-ca-certs to verify clients against")
        if self.ssl_ciphers is not None:
            if not self.ssl_certfile:
                raise ValueError("--ssl-ciphers needs --ssl-certfile/--ssl-keyfile")
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).set_ciphers(self.ssl_ciphers)
            except ssl.SSLError:
                raise ValueError(f"--ssl-ciphers {self.ssl_ciphers!r}: OpenSSL selects no "
                                 f"cipher from it") from None
        for flag, path in (("--ssl-certfile", self.ssl_certfile),
                           ("--ssl-keyfile", self.ssl_keyfile),
                           ("--ssl-ca-certs", self.ssl_ca_certs)):
            if path and not Path(path).is_file():
                raise ValueError(f"{flag}: no such file {path!r}")

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys a client may present (none: no auth)."""
        return tuple(k.strip() for k in self.api_key.split(",")) if self.api_key else ()

    @property
    def answer_settings(self) -> AnswerSettings:
        return AnswerSettings(self.return_tokens_as_token_ids, self.enable_force_include_usage)

    @property
    def tool_settings(self) -> ToolSettings:
        return ToolSettings(self.enable_auto_tool_choice, self.tool_call_parser,
                            self.exclude_tools_when_tool_choice_none)

    @cached_property
    def reasoning_settings(self) -> ReasoningSettings:
        return ReasoningSettings(self.reasoning_parser,
                                 parse_template_defaults(self.default_chat_template_kwargs))

    @cached_property
    def federate_targets(self) -> tuple[MetricsTarget, ...]:
        """The --metrics-federate processes (gateway/metrics_federation.py)."""
        return parse_targets(self.metrics_federate)

    @property
    def https(self) -> bool:
        return bool(self.ssl_certfile)

    @property
    def tls(self) -> TLSConfig:
        return TLSConfig(cert=self.tls_cert, key=self.tls_key, ca=self.tls_ca)


def _cors_list(flag: str, values: Sequence[str]) -> tuple[str, ...]:
    """A CORS list as given: comma-separated values, or vLLM's JSON list ('["a", "b"]', which
    the comma split has cut apart; put back together here)."""
    joined = ",".join(values).strip()
    if not joined.startswith("["):
        return tuple(v.strip() for v in values if v.strip())
    try:
        parsed = json.loads(joined)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not a JSON list: {exc}") from None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise ValueError(f"{flag}: expected a JSON list of strings")
    return tuple(parsed)


def parse_gateway_config(
    argv: Sequence[str] | None, env: Mapping[str, str] | None = None
) -> GatewayConfig:
    return parse_config(
        GatewayConfig, argv, prog="pdmesh gateway",
        description="OpenAI-compatible REST gateway in front of a pdmesh router",
        env=env,
    )
