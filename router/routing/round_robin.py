"""Round-robin: the baseline that ignores caches and load, for comparison and debugging."""

from __future__ import annotations

from collections.abc import Sequence

from pdmesh.router.routing.base import (
    Candidate,
    Decision,
    RouteRequest,
    RoutingPolicy,
)


class RoundRobinPolicy(RoutingPolicy):
    """Cycles through candidates ordered by instance id.

    The cursor counts decisions rather than remembering the last id, so instances joining or
    leaving only shift the rotation; every live instance still gets its turn.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.instance_id)
        chosen = ordered[self._cursor % len(ordered)]
        self._cursor += 1
        return Decision(
            instance_id=chosen.instance_id,
            cached_blocks=min(chosen.cached_blocks, request.prompt_blocks),
            cost=0.0,
            reason=f"round robin turn {self._cursor}",
        )
