"""Routing policies: pick one instance for a request from candidates with load and prefix data."""

from pdmesh.router.routing.base import (
    Candidate,
    Decision,
    LoadSnapshot,
    NoCandidateError,
    RouteRequest,
    RoutingPolicy,
)
from pdmesh.router.routing.factory import make_policy

__all__ = [
    "Candidate",
    "Decision",
    "LoadSnapshot",
    "NoCandidateError",
    "RouteRequest",
    "RoutingPolicy",
    "make_policy",
]
