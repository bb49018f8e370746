"""Planning a request: which decode instance, and which prefill instance if any.

Decode is chosen first (the Dynamo / llm-d shape), then the prefill/decode decision
(router/pd_decider.py) says whether a prefill instance is needed; with none live the decode
instance prefills (degraded, still serving). Choosing an instance of a role is llm-d's
pipeline: *filter* (the pool's routable instances of the role, less those this request
already failed on), *score and pick* (the role's routing policy, router/routing/, over
candidates carrying load and the prefix index's cached blocks; a request's prompt_cache_key,
its affinity, comes first while its instance is not overloaded). Re-routing and migration
choose through the same `choose`, with the plan's lookup.

The lookup keeps each instance's cached blocks split by the medium holding them (paged cache,
host or disk offload tier, `PrefixHits`): candidates carry the split, and prefix-aware routing
weighs a tier hit below a paged one (router/routing/README.md). What the lookup promised is
checked when the request finishes (`Planner.predictions`, router/prefix_predictions.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc
from opentelemetry import trace

from pdmesh.engine.block_hash import hash_token_blocks
from pdmesh.kvstore.prefix_index import PrefixHits, PrefixIndex
from pdmesh.kvstore.redis_conn import IndexUnavailable
from pdmesh.metrics import RouterMetrics
from pdmesh.router.failures import RouteError
from pdmesh.router.instance import Instance
from pdmesh.router.instances import InstancePool
from pdmesh.router.pd_decider import PrefillDecider
from pdmesh.router.prefix_predictions import DriftRule, PrefixPredictions
from pdmesh.router.request import Lookup, Plan, PreparedRequest
from pdmesh.router.routing.base import (
    Candidate,
    Decision,
    NoCandidateError,
    RouteRequest,
    RoutingPolicy,
)
from pdmesh.router.routing.prefix_aware import prefix_cost
from pdmesh.tracing import get_tracer

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
"""Routing's block size before any instance has said its own."""


def decision_reason(policy: RoutingPolicy, decision: Decision, num_candidates: int,
                    lookup: Lookup) -> str:
    """Why an instance was chosen, as a low-cardinality metric label."""
    if num_candidates == 1:
        return "single_candidate"
    if decision.affinity:
        return "prompt_cache_key"
    if not policy.uses_prefix_index:
        return policy.name
    if lookup.consulted and not lookup.ok:
        return "index_unavailable"
    return "cached_prefix" if decision.cached_blocks > 0 else "load"


class Planner:
    """Plans requests and chooses instances; one policy per role ("prefill", "decode"), so
    stateful ones stay fair within each role."""

    def __init__(self, pool: InstancePool, policies: dict[str, RoutingPolicy],
                 index: PrefixIndex | None, decider: PrefillDecider,
                 metrics: RouterMetrics, drift_rule: DriftRule | None = None) -> None:
        self.pool = pool
        self.policies = policies
        self.index = index
        self.decider = decider
        self.metrics = metrics
        # What the plans' lookups predicted, checked when each request finishes.
        self.predictions = PrefixPredictions(metrics, index, drift_rule)

    async def plan(self, req: PreparedRequest) -> Plan:
        with get_tracer().start_as_current_span("pdmesh.router.route") as span:
            lookup = await self.lookup(req)
            route = RouteRequest(len(req.prompt_token_ids),
                                 self.pool.block_size or DEFAULT_BLOCK_SIZE,
                                 affinity_key=req.prompt_cache_key)
            if span.is_recording():
                span.set_attributes({
                    "pdmesh.route.policy": self.policies["decode"].name,
                    "pdmesh.route.index_consulted": lookup.consulted,
                    "pdmesh.route.index_ok": lookup.ok,
                    "pdmesh.route.prompt_blocks": route.prompt_blocks,
                })
            decode = self.choose("decode", route, lookup)
            decision = self.decider.decide(
                decode.role, route, lookup.cached.get(decode.instance_id, 0))
            prefill: Instance | None = None
            reason = decision.reason
            if decision.remote:
                try:
                    prefill = self.choose("prefill", route, lookup)
                except RouteError:
                    # Degraded, still serving: the decode instance can prefill any prompt.
                    reason = "local prefill (no live prefill instance)"
            placement = "local" if prefill is None else "remote"
            self.metrics.prefill_placements.labels(placement).inc()
            span.set_attribute("pdmesh.route.prefill_placement", placement)
            span.set_attribute("pdmesh.route.uncached_tokens_on_decode", decision.uncached_tokens)
            return Plan(decode, prefill, reason, route, lookup)

    async def lookup(self, req: PreparedRequest) -> Lookup:
        """The leading prompt blocks each instance holds, when a policy wants to know and
        the index answers; routing goes on by load alone when it does not."""
        scheme = self.pool.scheme
        uses_index = any(p.uses_prefix_index for p in self.policies.values())
        if not uses_index or self.index is None or scheme is None:
            return Lookup({}, consulted=False, ok=False)
        hashes = hash_token_blocks(scheme, req.prompt_token_ids, req.cache_salt or None)
        started = time.monotonic()
        try:
            hits = await self.index.longest_prefix_by_medium(hashes)
        except IndexUnavailable as exc:
            self.metrics.index_lookups.labels("error").inc()
            self.pool.index_detail = f"redis unavailable: {exc}"
            logger.info("prefix lookup failed, routing on load only: %s", exc)
            return Lookup({}, consulted=True, ok=False)
        self.metrics.index_lookups.labels("ok").inc()
        self.metrics.index_lookup_duration.observe(time.monotonic() - started)
        cached = {instance_id: h.blocks for instance_id, h in hits.items()}
        return Lookup(cached, consulted=True, ok=True, tiers=hits)

    def choose(self, role: str, route: RouteRequest, lookup: Lookup,
               exclude: frozenset[str] = frozenset()) -> Instance:
        """The policy's pick among routable instances of `role` (addresses in `exclude` left
        out); UNAVAILABLE RouteError when there is none."""
        instances = [i for i in self.pool.routable(role)
                     if i.instance_id and i.address not in exclude]
        policy = self.policies[role]
        try:
            candidates = [with_tiers(i.candidate(lookup.cached), lookup.tiers)
                          for i in instances]
            decision = policy.choose(route, candidates)
        except NoCandidateError:
            raise RouteError(
                grpc.StatusCode.UNAVAILABLE, f"no live {role} instance to route to"
            ) from None
        chosen = next(i for i in instances if i.instance_id == decision.instance_id)
        reason = decision_reason(policy, decision, len(candidates), lookup)
        self.metrics.routing_decisions.labels(policy.name, role, reason).inc()
        _trace_choice(role, route, policy, decision, chosen, candidates, reason)
        logger.debug("routed role=%s to=%s reason=%s", role, chosen.address, decision.reason)
        return chosen


def with_tiers(candidate: Candidate, tiers: dict[str, PrefixHits]) -> Candidate:
    """The candidate with its cached blocks split by offload tier, when the index said so."""
    hits = tiers.get(candidate.instance_id)
    if hits is None or not (hits.host or hits.disk):
        return candidate
    return dataclasses.replace(candidate, host_blocks=hits.host, disk_blocks=hits.disk)


def _trace_choice(
    role: str, route: RouteRequest, policy: RoutingPolicy, decision: Decision,
    chosen: Instance, candidates: list[Candidate], reason: str,
) -> None:
    """Attributes of the routing span: who was chosen, why, and every candidate's score."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    prefix = f"pdmesh.route.{role}"
    span.set_attributes({
        f"{prefix}.instance_id": chosen.instance_id,
        f"{prefix}.address": chosen.address,
        f"{prefix}.cached_prefix_tokens": min(
            decision.cached_blocks * route.block_size, route.num_prompt_tokens),
        f"{prefix}.cost": decision.cost,
        f"{prefix}.reason": reason,
        f"{prefix}.detail": decision.reason,
        f"{prefix}.candidate_ids": [c.instance_id for c in candidates],
        f"{prefix}.candidate_cached_blocks": [c.cached_blocks for c in candidates],
        f"{prefix}.candidate_tier_blocks": [c.host_blocks + c.disk_blocks for c in candidates],
    })
    weight = getattr(policy, "prefix_weight", None)
    if weight is not None:
        span.set_attribute(f"{prefix}.candidate_costs",
                           [float(prefix_cost(route, c, weight)) for c in candidates])
