"""The request as the router carries it: admitted and tokenized, then planned.

`PreparedRequest` is what admission hands on (router/server.py); `Plan` is where it runs
(router/planner.py), and changes while it runs when a call is re-routed or migrated
(router/recovery.py). Plain data, shared by every part of a request's run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from pdmesh.router.failures import RouteError
from pdmesh.router.instance import Instance
from pdmesh.router.routing.base import RouteRequest
from pdmesh.v1 import common_pb2

if TYPE_CHECKING:
    from pdmesh.kvstore.prefix_index import PrefixHits


@dataclass
class PreparedRequest:
    """A validated, tokenized request, ready to route."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams
    n: int
    max_tokens: int  # resolved (unset = up to the context limit)
    cache_salt: str
    priority: int
    stream: bool
    received_at: float  # monotonic
    deadline: float  # monotonic
    tokenize_ms: float = 0.0
    prompt_cache_key: str = ""  # routing affinity (router/routing/base.py); "" = none

    def engine_fields(self) -> dict[str, Any]:
        """What every engine call (Prefill, PrefillStream, Decode) says of the request."""
        return {"request_id": self.request_id, "prompt_token_ids": self.prompt_token_ids,
                "sampling": self.sampling, "cache_salt": self.cache_salt,
                "priority": self.priority}

    def remaining_s(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        return remaining


@dataclass(frozen=True)
class Lookup:
    """What the prefix index said about a prompt."""

    cached: dict[str, int]  # leading prompt blocks held, by instance id
    consulted: bool  # a policy wanted the index and one is configured
    ok: bool  # ... and it answered
    tiers: dict[str, PrefixHits] = field(default_factory=dict)  # `cached` split by medium


@dataclass
class Plan:
    """Where a request runs: its decode instance and, unless it prefills there, its prefill
    instance. Kept with what routing saw, so a re-route or migration chooses the same way."""

    decode: Instance
    prefill: Instance | None  # None: the decode instance prefills locally
    reason: str
    route: RouteRequest  # kept for re-routing
    lookup: Lookup
