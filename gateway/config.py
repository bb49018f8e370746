"""Gateway configuration: one dataclass; CLI flags and PDMESH_<FIELD> env vars map onto it.

`parse_gateway_config(argv)` fills it (defaults < env < flags, see `grpc_common.parse_config`);
`__post_init__` validates it so a bad value stops the gateway at start-up naming the flag.
The API key is best given as PDMESH_API_KEY: a flag shows up in `ps` output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdmesh.grpc_common import DEFAULT_MAX_MESSAGE_BYTES, TLSConfig, parse_config, split_address

LOG_LEVELS = ("debug", "info", "warning", "error")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class GatewayConfig:
    router_address: str = field(
        default="127.0.0.1:50051", metadata=_help("host:port of the pdmesh router (gRPC)")
    )
    host: str = field(default="127.0.0.1", metadata=_help("HTTP address to listen on"))
    port: int = field(default=8000, metadata=_help("HTTP port; 0 picks a free one"))
    api_key: str | None = field(
        default=None, metadata=_help("require 'Authorization: Bearer <key>' on /v1/*")
    )
    request_timeout_s: float = field(
        default=600.0, metadata=_help("gRPC deadline of one generation request")
    )
    control_timeout_s: float = field(
        default=5.0, metadata=_help("gRPC deadline of ListModels, Tokenize and health checks")
    )
    max_request_bytes: int = field(
        default=16 * 2**20, metadata=_help("largest accepted HTTP request body")
    )
    tls_cert: str | None = field(
        default=None, metadata=_help("PEM client certificate for the router hop (mutual TLS)")
    )
    tls_key: str | None = field(default=None, metadata=_help("PEM private key for --tls-cert"))
    tls_ca: str | None = field(default=None, metadata=_help("PEM CA that signed the router's cert"))
    max_message_bytes: int = field(default=DEFAULT_MAX_MESSAGE_BYTES, metadata=_help("gRPC cap"))
    log_level: str = field(default="warning", metadata=_help(f"one of {', '.join(LOG_LEVELS)}"))

    def __post_init__(self) -> None:
        try:
            split_address(self.router_address)
        except ValueError as exc:
            raise ValueError(f"--router-address: {exc}") from None
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be blank (leave it unset to disable auth)")
        for name in ("request_timeout_s", "control_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        self.tls.validate(server=False)

    @property
    def tls(self) -> TLSConfig:
        return TLSConfig(cert=self.tls_cert, key=self.tls_key, ca=self.tls_ca)


def parse_gateway_config(
    argv: Sequence[str] | None, env: Mapping[str, str] | None = None
) -> GatewayConfig:
    return parse_config(
        GatewayConfig, argv, prog="pdmesh gateway",
        description="OpenAI-compatible REST gateway in front of a pdmesh router",
        env=env,
    )
