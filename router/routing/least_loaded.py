"""Least-loaded: the instance with the fewest active requests, then the fewest KV blocks."""

from __future__ import annotations

from collections.abc import Sequence

from pdmesh.router.routing.base import (
    Candidate,
    Decision,
    RouteRequest,
    RoutingPolicy,
)


class LeastLoadedPolicy(RoutingPolicy):
    name = "least_loaded"

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        best = min(
            candidates,
            key=lambda c: (c.load.active_requests, c.load.active_blocks, c.instance_id),
        )
        return Decision(
            instance_id=best.instance_id,
            cached_blocks=min(best.cached_blocks, request.prompt_blocks),
            cost=float(best.load.active_requests),
            reason=f"least loaded ({best.load.active_requests} active requests, "
            f"{best.load.active_blocks} active blocks)",
        )
