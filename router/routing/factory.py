"""Building a routing policy by its `--routing-policy` name.

Apart from `base.py` because it imports every policy, and every policy imports `base.py`: in
one module the two were an import cycle.
"""

from __future__ import annotations

from pdmesh.router.routing.base import POLICY_NAMES, RoutingPolicy
from pdmesh.router.routing.least_loaded import LeastLoadedPolicy
from pdmesh.router.routing.prefix_aware import PrefixAwarePolicy
from pdmesh.router.routing.round_robin import RoundRobinPolicy


def make_policy(name: str, *, prefix_weight: float = 1.0) -> RoutingPolicy:
    """Build a policy by its `--routing-policy` name."""
    if name == "prefix_aware":
        return PrefixAwarePolicy(prefix_weight=prefix_weight)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    raise ValueError(f"routing_policy must be one of {POLICY_NAMES}, got {name!r}")
