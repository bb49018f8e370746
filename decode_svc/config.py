"""Configuration of the decode service (shared fields: `EngineServiceConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pdmesh.config import about
from pdmesh.engine_svc.config import EngineServiceConfig

KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass
class DecodeConfig(EngineServiceConfig):
    role: Literal["decode", "colocated"] = field(
        default="decode", metadata=about("decode, or colocated (serves Prefill too)"))
    kv_fetch_timeout_s: float = field(default=30.0, metadata=about("deadline to pull one "
                                                                   "request's KV"))
    lease_s: float = field(default=30.0, metadata=about("colocated: KV lease for decode pulls"))
    kv_load_failure_policy: Literal["recompute", "fail"] = field(
        default="recompute", metadata=about("when a KV pull fails: recompute (prefill the "
                                            "prompt here, keep the first tokens) or fail"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.role not in ("decode", "colocated"):
            raise ValueError(f"--role must be decode or colocated, got {self.role!r}")
        if self.kv_fetch_timeout_s <= 0:
            raise ValueError(f"--kv-fetch-timeout-s must be > 0, got {self.kv_fetch_timeout_s}")
        if self.lease_s <= 0:
            raise ValueError(f"--lease-s must be > 0, got {self.lease_s}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"--kv-load-failure-policy must be one of "
                             f"{KV_LOAD_FAILURE_POLICIES}, got {self.kv_load_failure_policy!r}")
