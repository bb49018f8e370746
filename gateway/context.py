"""What every route shares: the config, the router client and the metrics (one set per app,
made at start-up)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdmesh.gateway.config import GatewayConfig
from pdmesh.gateway.metrics import GatewayMetrics
from pdmesh.gateway.router_client import RouterClient


@dataclass
class GatewayContext:
    config: GatewayConfig
    client: RouterClient
    metrics: GatewayMetrics
    started: int = field(default_factory=lambda: int(time.time()))
    _default_model: str | None = None

    async def model_name(self, requested: str) -> str:
        """The name echoed in responses: the request's, or the served model's (asked for
        once: a router serves one model, listed under its name first, then its aliases)."""
        if requested:
            return requested
        if self._default_model is None:
            models = await self.client.list_models()
            if not models:
                return ""
            self._default_model = models[0].id
        return self._default_model
