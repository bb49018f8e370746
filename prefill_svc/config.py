"""Configuration of the prefill service (shared fields: `EngineServiceConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdmesh.config import about
from pdmesh.engine_svc.config import EngineServiceConfig


@dataclass
class PrefillConfig(EngineServiceConfig):
    lease_s: float = field(default=30.0, metadata=about(
        "how long published KV waits for a decode pull (seconds)"))
    max_lease_s: float = field(default=300.0, metadata=about("cap on lease extensions"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lease_s <= 0:
            raise ValueError(f"--lease-s must be > 0, got {self.lease_s}")
        if self.max_lease_s < self.lease_s:
            raise ValueError(f"--max-lease-s ({self.max_lease_s}) must be >= --lease-s "
                             f"({self.lease_s})")
