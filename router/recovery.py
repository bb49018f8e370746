"""Where a request goes when an instance fails it: re-routing, local prefill, migration.

Re-routing (`Unreached`, router/failures.py): a call that failed before anything of it
reached the client goes to another instance of its role, each instance at most once, within
the request's deadline. A re-routed Decode keeps the KV handle (the blocks stay leased on the
prefill side) and the prefill's first tokens, so the client sees no duplicate. A Prefill with
no prefill instance left is done by the decode instance itself (local prefill).

Migration (`Broken`): a Decode stream that broke after its instance answered resumes on
another healthy decode instance, at most `migration_limit` times per request and within its
deadline. The next instance gets the original prompt and sampling parameters plus, per output
sequence, the tokens and text the router already handed on (`resume_state`); it prefills
prompt + tokens itself and counts the tokens as output, and a seeded sequence skips the draws
that produced them, so the client's stream continues token-exact. With n > 1 one migration
moves every unfinished sequence, each from its own point (finished ones are replayed, never
continued). Only when migration is off, spent, out of time or without a decode instance left
does the request fail: FINISH_REASON_ERROR for its open sequences, or a status when nothing
was sent.

`Recovery` keeps the request's plan and its load slots moving together, and counts every move
(`pdmesh:router_reroutes_total`, `pdmesh:router_migrations_total`) with a span event.
"""

from __future__ import annotations

import logging
import time

import grpc
from opentelemetry import trace

from pdmesh.metrics import RouterMetrics
from pdmesh.router.failures import Broken, RouteError, Unreached
from pdmesh.router.instance import Instance
from pdmesh.router.load_slots import LoadSlots
from pdmesh.router.planner import Planner
from pdmesh.router.request import Plan, PreparedRequest
from pdmesh.router.responses import Assembler
from pdmesh.v1 import engine_pb2

logger = logging.getLogger(__name__)


def resume_state(out: Assembler) -> list[engine_pb2.ResumedSequence]:
    """Everything the router holds of each sequence: what the next instance continues."""
    return [
        engine_pb2.ResumedSequence(index=index, token_ids=seq.token_ids,
                                   text="".join(seq.text), finished=seq.finish is not None)
        for index, seq in enumerate(out.sequences)
    ]


class Recovery:
    """One request's moves: the instances it failed on (either role) and its migrations."""

    def __init__(self, req: PreparedRequest, plan: Plan, slots: LoadSlots, planner: Planner,
                 metrics: RouterMetrics, migration_limit: int) -> None:
        self.req = req
        self.plan = plan
        self.slots = slots
        self.planner = planner
        self.metrics = metrics
        self.migration_limit = migration_limit  # broken decode streams resumed per request
        self.tried: set[str] = set()  # addresses that failed this request, by either role
        self.migrations = 0  # times the decode stream moved to another instance

    def reroute(self, role: str, failed: Instance, unreached: Unreached) -> Instance:
        """Move the `role` call `failed` never served to another instance of the role;
        RouteError (the failure, UNAVAILABLE, or DEADLINE_EXCEEDED) when there is none or no
        time left."""
        self.tried.add(failed.address)
        self.req.remaining_s()
        try:
            chosen = self._choose(role)
        except RouteError:
            raise RouteError(
                grpc.StatusCode.UNAVAILABLE, f"{unreached.error}; no other {role} instance left"
            ) from None
        self.metrics.reroutes.labels(role, unreached.reason).inc()
        trace.get_current_span().add_event("pdmesh.reroute", {
            "pdmesh.role": role, "pdmesh.reroute.from": failed.address,
            "pdmesh.reroute.to": chosen.address, "pdmesh.reroute.reason": unreached.reason,
        })
        logger.info("re-routed request_id=%s role=%s from=%s to=%s reason=%s",
                    self.req.request_id, role, failed.address, chosen.address, unreached.reason)
        self._place(role, chosen)
        return chosen

    def prefill_locally(self, failed: Instance, failure: Unreached) -> None:
        """No prefill instance is left for this request: its decode instance prefills."""
        decode = self.plan.decode
        self._place("prefill", None)
        self.metrics.reroutes.labels("prefill", failure.reason).inc()
        trace.get_current_span().add_event("pdmesh.reroute", {
            "pdmesh.role": "prefill", "pdmesh.reroute.from": failed.address,
            "pdmesh.reroute.to": decode.address, "pdmesh.reroute.reason": failure.reason,
            "pdmesh.reroute.local_prefill": True,
        })
        logger.info("prefill falls back to the decode instance request_id=%s from=%s to=%s "
                    "reason=%s", self.req.request_id, failed.address, decode.address,
                    failure.reason)

    def migrate(self, failed: Instance, broken: Broken, produced: int) -> Instance | None:
        """Move a broken decode stream (`produced` tokens so far) to another decode instance;
        None when migration is off or spent, the deadline has passed, or no other decode
        instance is left."""
        self.tried.add(failed.address)
        if self.migrations >= self.migration_limit:
            logger.info("not migrating request_id=%s: migration limit %d reached (%s)",
                        self.req.request_id, self.migration_limit, broken.reason)
            return None
        if self.req.deadline <= time.monotonic():
            return None
        try:
            chosen = self._choose("decode")
        except RouteError:
            logger.info("not migrating request_id=%s: no other decode instance left",
                        self.req.request_id)
            return None
        self.migrations += 1
        self.metrics.migrations.labels(broken.reason).inc()
        trace.get_current_span().add_event("pdmesh.migration", {
            "pdmesh.migration.from": failed.address, "pdmesh.migration.to": chosen.address,
            "pdmesh.migration.reason": broken.reason, "pdmesh.migration.attempt": self.migrations,
            "pdmesh.migration.tokens_so_far": produced,
        })
        logger.info("migrated request_id=%s from=%s to=%s reason=%s tokens_so_far=%d",
                    self.req.request_id, failed.address, chosen.address, broken.reason, produced)
        self._place("decode", chosen)
        return chosen

    def _choose(self, role: str) -> Instance:
        return self.planner.choose(role, self.plan.route, self.plan.lookup,
                                   exclude=frozenset(self.tried))

    def _place(self, role: str, instance: Instance | None) -> None:
        """The request's `role` call now runs on `instance`: its plan and its load slot."""
        if role == "decode":
            assert instance is not None
            self.plan.decode = instance
        else:
            self.plan.prefill = instance
        self.slots.move(role, instance)
