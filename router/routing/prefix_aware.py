"""Prefix-aware routing with Dynamo's cost function (see README.md for a worked example).

    cost(i) = prefix_weight × uncached_prompt_blocks(i) + active_blocks(i)

A cached block held only in an offload tier counts as a fraction of a paged one
(`HOST_HIT_WEIGHT`, `DISK_HIT_WEIGHT`): the engine restores it by a copy instead of computing
it, and the copy is not free.

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

HOST_HIT_WEIGHT = 0.9
"""A block in the host tier saves this much of a paged hit: its restore is one memcpy (or a
PCIe copy from pinned memory) and a checksum, ~5-10 % of recomputing 16 tokens."""
DISK_HIT_WEIGHT = 0.5
"""A block in the disk tier: a file read, a checksum and a copy, about half the price of
recomputing it on a small model (and more of it on a large one: conservative)."""


def effective_cached_blocks(request: RouteRequest, candidate: Candidate) -> float:
    """Cached prompt blocks in paged-hit units: tier hits weighed by their restore cost."""
    cached = min(candidate.cached_blocks, request.prompt_blocks)
    disk = min(candidate.disk_blocks, cached)
    host = min(candidate.host_blocks, cached - disk)
    return (cached - host - disk) + HOST_HIT_WEIGHT * host + DISK_HIT_WEIGHT * disk


def prefix_cost(request: RouteRequest, candidate: Candidate, prefix_weight: float) -> float:
    uncached = request.prompt_blocks - effective_cached_blocks(request, candidate)
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
                -effective_cached_blocks(request, c),
                c.instance_id,
            ),
        )
        cost = prefix_cost(request, best, self.prefix_weight)
        return Decision(
            instance_id=best.instance_id,
            cached_blocks=min(best.cached_blocks, request.prompt_blocks),
            cost=cost,
            reason=f"min cost {cost:g} (cached {best.cached_blocks}/{request.prompt_blocks} "
            f"blocks{_tiers(best)}, active {best.load.active_blocks})",
        )


def _tiers(candidate: Candidate) -> str:
    if not candidate.host_blocks and not candidate.disk_blocks:
        return ""
    return f" of which {candidate.host_blocks} host, {candidate.disk_blocks} disk"
