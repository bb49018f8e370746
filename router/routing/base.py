"""The routing interface: a policy is a pure choice over candidates the caller assembled.

The caller (router/planner.py) gathers everything a policy may look at — each live instance's
load snapshot and, for prefix-aware routing, how many leading prompt blocks the cluster index
says it holds — so policies stay synchronous, deterministic and unit-testable. Only the
round-robin policy keeps state (its cursor).

The policies import this module, so it imports none of them: `factory.py` builds one by name.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


class NoCandidateError(RuntimeError):
    """No live instance can take the request."""


@dataclass(frozen=True)
class LoadSnapshot:
    """What an instance reported in its last GetLoad, plus the router's own in-flight count.

    `inflight_blocks` covers requests this router sent since the last poll and that the
    engine may not report yet; the policies use the larger of the two views.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    inflight_requests: int = 0
    inflight_blocks: int = 0

    @property
    def used_blocks(self) -> int:
        return max(0, self.num_total_blocks - self.num_free_blocks)

    @property
    def active_blocks(self) -> int:
        return max(self.used_blocks, self.inflight_blocks)

    @property
    def active_requests(self) -> int:
        return max(self.num_running + self.num_waiting, self.inflight_requests)


@dataclass(frozen=True)
class Candidate:
    instance_id: str
    load: LoadSnapshot
    cached_blocks: int = 0  # leading prompt blocks the instance holds (prefix index)


@dataclass(frozen=True)
class RouteRequest:
    num_prompt_tokens: int
    block_size: int

    @property
    def prompt_blocks(self) -> int:
        return math.ceil(self.num_prompt_tokens / self.block_size)


@dataclass(frozen=True)
class Decision:
    instance_id: str
    cached_blocks: int
    cost: float
    reason: str


class RoutingPolicy(ABC):
    """Choose one candidate. Implementations must not mutate the candidates."""

    name: str = ""
    uses_prefix_index: bool = False

    @abstractmethod
    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision: ...


def require_candidates(candidates: Sequence[Candidate]) -> None:
    if not candidates:
        raise NoCandidateError("no live instance to route to")


POLICY_NAMES = ("prefix_aware", "round_robin", "least_loaded")
"""The `--routing-policy` names; `factory.make_policy` builds each."""

