"""Prefix-aware routing with Dynamo's cost function (see README.md for a worked example).

    cost(i) = prefix_weight × uncached_prompt_blocks(i) + active_blocks(i)

`uncached_prompt_blocks` is the work the instance would have to redo for this prompt (the
prompt's blocks minus the leading blocks the index says it holds); `active_blocks` is the KV
it already carries for other requests, a proxy for how much the new request will be slowed by
sharing its batch. Both are in blocks, so the weight is a plain exchange rate: with weight 1,
one cached block is worth exactly one block of load. Ties go to the longer cached prefix, then
to the lower instance id, so decisions are reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdmesh.router.routing.base import (
    Candidate,
    Decision,
    RouteRequest,
    RoutingPolicy,
)


def prefix_cost(request: RouteRequest, candidate: Candidate, prefix_weight: float) -> float:
    cached = min(candidate.cached_blocks, request.prompt_blocks)
    uncached = request.prompt_blocks - cached
    return prefix_weight * uncached + candidate.load.active_blocks


class PrefixAwarePolicy(RoutingPolicy):
    name = "prefix_aware"
    uses_prefix_index = True

    def __init__(self, prefix_weight: float = 1.0) -> None:
        if not prefix_weight >= 0:
            raise ValueError(f"prefix_weight must be >= 0, got {prefix_weight}")
        self.prefix_weight = prefix_weight

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        best = min(
            candidates,
            key=lambda c: (
                prefix_cost(request, c, self.prefix_weight),
                -c.cached_blocks,
                c.instance_id,
            ),
        )
        cost = prefix_cost(request, best, self.prefix_weight)
        return Decision(
            instance_id=best.instance_id,
            cached_blocks=min(best.cached_blocks, request.prompt_blocks),
            cost=cost,
            reason=f"min cost {cost:g} (cached {best.cached_blocks}/{request.prompt_blocks} "
            f"blocks, active {best.load.active_blocks})",
        )
