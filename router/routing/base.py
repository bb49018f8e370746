"""The routing interface: a policy is a pure choice over candidates the caller assembled.

The caller (router/planner.py) gathers everything a policy may look at — each live instance's
load snapshot and, for prefix-aware routing, how many leading prompt blocks the cluster index
says it holds — so policies stay synchronous, deterministic and unit-testable. Only the
round-robin policy keeps state (its cursor).

The policies import this module, so it imports none of them: `factory.py` builds one by name.

A request's affinity key (OpenAI's `prompt_cache_key`) comes before any policy: its requests go
to the instance the key hashes to among the candidates (rendezvous hashing: the same instance
while it stays live, whoever else joins or leaves, and the same answer on every router), unless
that instance is overloaded (`overloaded`), when the policy picks as without a key.
"""

from __future__ import annotations

import hashlib
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
    # Of those, the blocks it holds only in its host / disk offload tier (restored by a copy
    # before they serve; kvstore/prefix_index.py PrefixHits); the rest are in its paged cache.
    host_blocks: int = 0
    disk_blocks: int = 0

    @property
    def paged_blocks(self) -> int:
        return max(0, self.cached_blocks - self.host_blocks - self.disk_blocks)


@dataclass(frozen=True)
class RouteRequest:
    num_prompt_tokens: int
    block_size: int
    affinity_key: str = ""  # prompt_cache_key; "" = none

    @property
    def prompt_blocks(self) -> int:
        return math.ceil(self.num_prompt_tokens / self.block_size)


@dataclass(frozen=True)
class Decision:
    instance_id: str
    cached_blocks: int
    cost: float
    reason: str
    affinity: bool = False  # chosen by the request's affinity key, not the policy


AFFINITY_MAX_KV_USE = 0.9
"""An affinity instance with this share of its KV blocks active is overloaded."""

AFFINITY_MAX_EXTRA_REQUESTS = 8
"""... and so is one with more active requests than this over the least busy candidate: a hot
key spreads once its instance queues work that others could start now."""


def overloaded(load: LoadSnapshot, least_active_requests: int) -> bool:
    """Whether an affinity instance should give way to the policy."""
    full = load.num_total_blocks > 0 and \
        load.active_blocks >= AFFINITY_MAX_KV_USE * load.num_total_blocks
    return full or load.active_requests > least_active_requests + AFFINITY_MAX_EXTRA_REQUESTS


def affinity_score(key: str, instance_id: str) -> bytes:
    """Rendezvous hashing's weight of an instance for a key (the highest wins)."""
    return hashlib.blake2b(f"{instance_id}\0{key}".encode("utf-8", "surrogatepass"),
                           digest_size=8).digest()


def affinity_candidate(request: RouteRequest, candidates: Sequence[Candidate]
                       ) -> Candidate | None:
    """The candidate the request's affinity key maps to, unless it is overloaded; None
    without a key."""
    if not request.affinity_key or not candidates:
        return None
    target = max(candidates, key=lambda c: (affinity_score(request.affinity_key,
                                                           c.instance_id), c.instance_id))
    least = min(c.load.active_requests for c in candidates)
    return None if overloaded(target.load, least) else target


class RoutingPolicy(ABC):
    """Choose one candidate. Implementations must not mutate the candidates."""

    name: str = ""
    uses_prefix_index: bool = False

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """The affinity key's instance when it has one and it is not overloaded, else the
        policy's pick (`pick`)."""
        require_candidates(candidates)
        held = affinity_candidate(request, candidates)
        if held is None:
            return self.pick(request, candidates)
        return Decision(
            instance_id=held.instance_id,
            cached_blocks=min(held.cached_blocks, request.prompt_blocks),
            cost=0.0,
            reason=f"prompt_cache_key affinity ({held.load.active_requests} active requests, "
            f"{held.load.active_blocks} active blocks)",
            affinity=True,
        )

    @abstractmethod
    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """The policy's own choice among non-empty `candidates`."""


def require_candidates(candidates: Sequence[Candidate]) -> None:
    if not candidates:
        raise NoCandidateError("no live instance to route to")


POLICY_NAMES = ("prefix_aware", "round_robin", "least_loaded")
"""The `--routing-policy` names; `factory.make_policy` builds each."""

