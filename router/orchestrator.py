"""One request's trip through the mesh: route, prefill (maybe remotely), decode, stream back.

Decode is chosen first (the Dynamo / llm-d shape). If the prompt's part *not* cached on that
decode instance is below `local_prefill_threshold` tokens, the decode instance prefills
locally and no KV moves (conditional disaggregation). Otherwise a prefill instance is chosen
with the same policy, Prefill runs there, its first tokens go to the client at once, and
Decode continues with the KV handle; the decode instance pulls the KV straight from the
prefill instance.

Failure mapping (router.proto): before any output was sent to the client, a gRPC status (the
instance's status where it is meaningful to the client, UNAVAILABLE naming the instance and
carrying a retry hint otherwise); after output was sent, unfinished sequences end with
FINISH_REASON_ERROR and the stream still ends with a GenerateResult. With stream=false nothing
is sent before the end, so every failure is a status. A failing instance leaves routing at
once. A cancelled client call cancels the Decode stream and releases the prefill side's KV,
so every block comes back.

Re-routing: a Prefill or Decode call that could not reach its instance (gRPC's own
UNAVAILABLE: connection refused or lost, server shutting down) before that instance answered
anything is sent to another instance of the role, each instance at most once, within the
request's deadline. A re-routed Decode keeps the KV handle (the blocks stay leased on the
prefill side) and the prefill's first tokens: the decode instance never repeats them, so the
client sees no duplicate. An instance's own answers about the request (INVALID_ARGUMENT,
RESOURCE_EXHAUSTED, ...) are never retried elsewhere.

Prefill failures: nothing reaches the client before the Prefill answer, so a Prefill that
fails through its instance's fault (unreachable, UNAVAILABLE, INTERNAL, ...) goes to another
prefill instance, and when none is left the decode instance prefills the prompt itself; with
no live prefill instance at all every request is planned with local prefill (degraded, still
serving). A failed KV pull is the prefill instance's fault, and it is charged there (it leaves
routing until a poll succeeds), never to the decode instance: the decode instance either
recomputed the prompt (`DecodeResult.kv_load_fallback`, `--kv-load-failure-policy recompute`)
or refused with `kv_load_failed` (policy `fail`: UNAVAILABLE before output, an error finish
after).

Decode migration: a Decode stream that breaks after its instance answered (the process died,
UNAVAILABLE, INTERNAL, a lost connection, the call cancelled under the router when its
channel closed, a stream without its result) is resumed on another
healthy decode instance, at most `migration_limit` times per request and within its deadline.
The router holds every token and every piece of text it has handed on; the next instance gets
the original prompt and sampling parameters plus, per output sequence, those tokens and that
text (`DecodeRequest.resume`). It prefills prompt + tokens itself (prefix-cache friendly) and
counts the tokens as output (max_tokens, min_tokens, penalties, stop strings); a seeded
sequence's generator skips one draw per given token (the draws that produced them), so
sampling continues exactly as an uninterrupted run would. Deltas continue after what the
client has: one stream, no duplicate, missing or reordered token, no error event. With n > 1
one migration moves every unfinished sequence, each from its own point with its own child
seed (finished ones are replayed, never continued). Usage stays the undisturbed run's: the
original prompt, every token produced, the original prefill's cached-token count (after a
local prefill, whose count died with its instance, the new instance's prompt hits). Only when
migration is off, spent, out of time or without a decode instance left does the stream end
as above (FINISH_REASON_ERROR, or a status when nothing was sent).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace

from pdmesh.auth import ClusterToken
from pdmesh.engine.block_hash import hash_token_blocks
from pdmesh.grpc_common import KV_LOAD_FAILED, refused_reason
from pdmesh.kvstore.prefix_index import PrefixIndex
from pdmesh.kvstore.redis_conn import IndexUnavailable
from pdmesh.kvstore.transfer.capability import TransferCapability
from pdmesh.metrics import RouterMetrics, router_metrics
from pdmesh.router.instances import Instance, InstancePool
from pdmesh.router.routing.base import (
    Candidate,
    Decision,
    NoCandidateError,
    RouteRequest,
    RoutingPolicy,
)
from pdmesh.router.routing.prefix_aware import prefix_cost
from pdmesh.tracing import gen_ai_response_attributes, get_tracer, inject_metadata
from pdmesh.v1 import common_pb2, engine_pb2, router_pb2

logger = logging.getLogger(__name__)

Send = Callable[[router_pb2.GenerateResponse], Awaitable[None]]

# Statuses that say the instance itself is broken, not the request. CANCELLED comes back
# as a status only when the far end cut the call (the router's own cancellations raise
# CancelledError instead): its server tore the call down.
_INSTANCE_FAULTS = {
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DATA_LOSS,
}
# gRPC's own wording when a call never reached a live server or the server went away before
# answering; our servicers word their UNAVAILABLE aborts differently ("KV transfer ...").
_UNREACHED_DETAILS = (
    ("failed to connect", "unreachable"),
    ("connection refused", "unreachable"),
    ("cancelling all calls", "shutting_down"),  # grpc server stop(): in-flight calls cut
    ("goaway", "shutting_down"),
    ("socket closed", "connection_lost"),
    ("connection reset", "connection_lost"),
    ("broken pipe", "connection_lost"),
)
UNAVAILABLE_RETRY_AFTER_S = 1.0
"""The retry hint sent with UNAVAILABLE: about a poll interval, when membership is known anew."""
# Statuses an instance may return that mean the same to the client.
_PASS_THROUGH = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ALREADY_EXISTS,
}


class RouteError(Exception):
    """A request that fails before any output: the server turns it into a gRPC status.

    `retry_after_s` (default for UNAVAILABLE) goes back as the retry hint trailing metadata."""

    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None
    ) -> None:
        self.code = code
        if retry_after_s is None and code == grpc.StatusCode.UNAVAILABLE:
            retry_after_s = UNAVAILABLE_RETRY_AFTER_S
        self.retry_after_s = retry_after_s
        super().__init__(message)


def unreached_reason(exc: grpc.aio.AioRpcError) -> str | None:
    """Why a call failed without reaching a working instance ("unreachable",
    "connection_lost", "shutting_down", or the reason of an instance's `refuse()`), or None
    when the instance itself answered with an error. Only these failures are safe to send to
    another instance."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    refused = refused_reason(exc)
    if refused is not None:
        return refused
    details = (exc.details() or "").lower()
    return next((reason for marker, reason in _UNREACHED_DETAILS if marker in details), None)


def _fault_reason(exc: grpc.aio.AioRpcError) -> str | None:
    """"instance_fault" when the instance answered with a fault of its own (INTERNAL,
    UNAVAILABLE, ...), not an answer about the request (INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, ...); else None."""
    return "instance_fault" if exc.code() in _INSTANCE_FAULTS else None


class _Unreached(Exception):
    """A call that failed before anything of it reached the client and may go to another
    instance: it never reached a working instance (or, for Prefill, whose answer comes before
    any output, the instance failed with a fault of its own). Re-route it, or fail with
    `error`."""

    def __init__(self, error: RouteError, reason: str) -> None:
        self.error = error
        self.reason = reason
        super().__init__(str(error))


class _Broken(Exception):
    """A Decode stream that broke through its instance's fault before the request finished
    (its instance already cleaned up): migrate it, or fail with `error`."""

    def __init__(self, error: RouteError, reason: str) -> None:
        self.error = error
        self.reason = reason  # low-cardinality metric label
        super().__init__(str(error))


def cancelled_from_outside() -> bool:
    """Whether the running task was asked to cancel (its client went away, shutdown), as
    opposed to a CancelledError raised by a gRPC call that was cancelled under it."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def broken_reason(exc: grpc.aio.AioRpcError) -> str:
    """Why a Decode stream broke, as a metric label (connection_lost, unavailable, ...)."""
    return unreached_reason(exc) or exc.code().name.lower()


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

    def remaining_s(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        return remaining


@dataclass
class _Sequence:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish: common_pb2.Finish | None = None


class Assembler:
    """Collects the deltas of the n sequences: forwards them as they come (stream=true) or
    collapses them into one delta per sequence (stream=false)."""

    def __init__(self, n: int) -> None:
        self.sequences = [_Sequence() for _ in range(n)]

    def add(self, delta: common_pb2.SequenceDelta) -> None:
        if delta.index >= len(self.sequences):
            raise RouteError(grpc.StatusCode.INTERNAL, f"delta for unknown index {delta.index}")
        seq = self.sequences[delta.index]
        seq.token_ids.extend(delta.token_ids)
        seq.text.append(delta.text)
        seq.logprobs.extend(delta.logprobs)
        if delta.HasField("finish"):
            seq.finish = delta.finish

    @property
    def started(self) -> bool:
        return any(s.token_ids for s in self.sequences)

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    def fail_unfinished(self, message: str) -> list[common_pb2.SequenceDelta]:
        """Finish-only deltas ending every open sequence with FINISH_REASON_ERROR."""
        out = []
        for index, seq in enumerate(self.sequences):
            if seq.finish is None:
                seq.finish = common_pb2.Finish(
                    reason=common_pb2.FINISH_REASON_ERROR, message=message
                )
                out.append(common_pb2.SequenceDelta(index=index, finish=seq.finish))
        return out

    def collapsed(self) -> list[common_pb2.SequenceDelta]:
        return [
            common_pb2.SequenceDelta(
                index=index,
                token_ids=seq.token_ids,
                text="".join(seq.text),
                logprobs=seq.logprobs,
                finish=seq.finish,
            )
            for index, seq in enumerate(self.sequences)
        ]


@dataclass(frozen=True)
class _Lookup:
    """What the prefix index said about a prompt."""

    cached: dict[str, int]  # leading prompt blocks held, by instance id
    consulted: bool  # a policy wanted the index and one is configured
    ok: bool  # ... and it answered


@dataclass
class _Plan:
    decode: Instance
    prefill: Instance | None  # None: the decode instance prefills locally
    reason: str
    route: RouteRequest  # kept for re-routing
    lookup: _Lookup


def decision_reason(policy: RoutingPolicy, decision: Decision, num_candidates: int,
                    lookup: _Lookup) -> str:
    """Why an instance was chosen, as a low-cardinality metric label."""
    if num_candidates == 1:
        return "single_candidate"
    if not policy.uses_prefix_index:
        return policy.name
    if lookup.consulted and not lookup.ok:
        return "index_unavailable"
    return "cached_prefix" if decision.cached_blocks > 0 else "load"


def _finish_name(reason: int) -> str:
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


class Orchestrator:
    def __init__(
        self,
        pool: InstancePool,
        policies: dict[str, RoutingPolicy],
        index: PrefixIndex | None,
        *,
        local_prefill_threshold: int,
        rpc_timeout_s: float,
        migration_limit: int = 3,
        metrics: RouterMetrics | None = None,
        token: ClusterToken | None = None,
    ) -> None:
        self.pool = pool
        self.token = token  # binds each KV handle to the decode instance it is sent to
        self.migration_limit = migration_limit  # broken decode streams resumed per request
        self.metrics = metrics or router_metrics()
        self.policies = policies  # one per role ("prefill", "decode"): stateful ones stay fair
        self.index = index
        self.local_prefill_threshold = local_prefill_threshold
        self.rpc_timeout_s = rpc_timeout_s
        self._background: set[asyncio.Task[Any]] = set()

    # -- routing -----------------------------------------------------------------------------
    async def cached_blocks(self, req: PreparedRequest) -> dict[str, int]:
        """Leading prompt blocks each instance holds; {} when the index cannot say."""
        return (await self._lookup(req)).cached

    async def _lookup(self, req: PreparedRequest) -> _Lookup:
        scheme = self.pool.scheme
        uses_index = any(p.uses_prefix_index for p in self.policies.values())
        if not uses_index or self.index is None or scheme is None:
            return _Lookup({}, consulted=False, ok=False)
        hashes = hash_token_blocks(scheme, req.prompt_token_ids, req.cache_salt or None)
        started = time.monotonic()
        try:
            cached = await self.index.longest_prefix(hashes)
        except IndexUnavailable as exc:
            self.metrics.index_lookups.labels("error").inc()
            self.pool.index_detail = f"redis unavailable: {exc}"
            logger.info("prefix lookup failed, routing on load only: %s", exc)
            return _Lookup({}, consulted=True, ok=False)
        self.metrics.index_lookups.labels("ok").inc()
        self.metrics.index_lookup_duration.observe(time.monotonic() - started)
        return _Lookup(cached, consulted=True, ok=True)

    def _choose(
        self, role: str, route: RouteRequest, lookup: _Lookup,
        exclude: frozenset[str] = frozenset(),
    ) -> Instance:
        """The policy's pick among routable instances of `role` (addresses in `exclude` left
        out); UNAVAILABLE RouteError when there is none."""
        instances = [i for i in self.pool.routable(role)
                     if i.instance_id and i.address not in exclude]
        policy = self.policies[role]
        try:
            candidates = [i.candidate(lookup.cached) for i in instances]
            decision = policy.choose(route, candidates)
        except NoCandidateError:
            raise RouteError(
                grpc.StatusCode.UNAVAILABLE, f"no live {role} instance to route to"
            ) from None
        chosen = next(i for i in instances if i.instance_id == decision.instance_id)
        reason = decision_reason(policy, decision, len(candidates), lookup)
        self.metrics.routing_decisions.labels(policy.name, role, reason).inc()
        self._trace_choice(role, route, policy, decision, chosen, candidates, reason)
        logger.debug("routed role=%s to=%s reason=%s", role, chosen.address, decision.reason)
        return chosen

    @staticmethod
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
        })
        weight = getattr(policy, "prefix_weight", None)
        if weight is not None:
            span.set_attribute(f"{prefix}.candidate_costs",
                               [float(prefix_cost(route, c, weight)) for c in candidates])

    async def plan(self, req: PreparedRequest) -> _Plan:
        with get_tracer().start_as_current_span("pdmesh.router.route") as span:
            lookup = await self._lookup(req)
            block_size = self.pool.block_size or 16
            route = RouteRequest(len(req.prompt_token_ids), block_size)
            if span.is_recording():
                span.set_attributes({
                    "pdmesh.route.policy": self.policies["decode"].name,
                    "pdmesh.route.index_consulted": lookup.consulted,
                    "pdmesh.route.index_ok": lookup.ok,
                    "pdmesh.route.prompt_blocks": route.prompt_blocks,
                })
            decode = self._choose("decode", route, lookup)
            held = min(lookup.cached.get(decode.instance_id, 0) * block_size,
                       route.num_prompt_tokens)
            uncached = route.num_prompt_tokens - held
            prefill: Instance | None = None
            if decode.role == "colocated" or uncached < self.local_prefill_threshold:
                reason = f"local prefill ({uncached} uncached tokens)"
            else:
                try:
                    prefill = self._choose("prefill", route, lookup)
                    reason = f"remote prefill ({uncached} uncached tokens on decode)"
                except RouteError:
                    # Degraded, still serving: the decode instance can prefill any prompt.
                    reason = "local prefill (no live prefill instance)"
            plan = _Plan(decode, prefill, reason, route, lookup)
            placement = "local" if plan.prefill is None else "remote"
            self.metrics.prefill_placements.labels(placement).inc()
            span.set_attribute("pdmesh.route.prefill_placement", placement)
            span.set_attribute("pdmesh.route.uncached_tokens_on_decode", uncached)
            return plan

    # -- running -----------------------------------------------------------------------------
    async def run(self, req: PreparedRequest, send: Send) -> None:
        """Serve `req`, sending GenerateResponses through `send`; RouteError before output."""
        plan = await self.plan(req)
        block_size = self.pool.block_size or 16
        prompt_blocks = math.ceil(len(req.prompt_token_ids) / block_size)
        kv_blocks = math.ceil((len(req.prompt_token_ids) + req.max_tokens * req.n) / block_size)
        slots = {"decode": _Slot(plan.decode, kv_blocks),
                 "prefill": _Slot(plan.prefill, prompt_blocks)}
        try:
            await _Run(self, req, plan, send, slots).execute()
        finally:
            for slot in slots.values():
                slot.release()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Fire-and-forget cleanup that must outlive a cancelled request."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait for cleanup calls still in flight (shutdown)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout_s)


class _Slot:
    """One request's share of an instance's in-flight count (what routing sees as its load);
    it moves with the request when the request is re-routed."""

    def __init__(self, instance: Instance | None, blocks: int) -> None:
        self.blocks = blocks
        self.instance: Instance | None = None
        self.started = 0.0
        self.move(instance)

    def move(self, instance: Instance | None) -> None:
        self.release()
        if instance is not None:
            self.started = instance.request_started(self.blocks)
        self.instance = instance

    def release(self) -> None:
        if self.instance is not None:
            self.instance.request_finished(self.blocks, self.started)
            self.instance = None


def _merge_timing(
    req: PreparedRequest, ttft_ms: float, parts: list[common_pb2.Timing]
) -> common_pb2.Timing:
    timing = common_pb2.Timing(
        tokenize_ms=req.tokenize_ms,
        ttft_ms=ttft_ms,
        e2e_ms=(time.monotonic() - req.received_at) * 1000,
    )
    for part in parts:
        timing.queue_ms += part.queue_ms
        timing.prefill_ms += part.prefill_ms
        timing.kv_transfer_ms += part.kv_transfer_ms
        timing.decode_ms += part.decode_ms
    return timing


class _Run:
    """The state of one request while it runs (kept off the shared Orchestrator)."""

    def __init__(self, orch: Orchestrator, req: PreparedRequest, plan: _Plan, send: Send,
                 slots: dict[str, _Slot]):
        self.orch = orch
        self.req = req
        self.plan = plan
        self._send = send
        self._slots = slots
        self.tried: set[str] = set()  # addresses that failed this request, by either role
        self.sent = False  # a delta went to the client: failures can no longer be a status
        self.out = Assembler(req.n)
        self.ttft_ms = 0.0
        self.timings: list[common_pb2.Timing] = []
        self.prefill_resp: engine_pb2.PrefillResponse | None = None
        self.migrations = 0  # times the decode stream moved to another instance
        self.prompt_logprobs_sent = False

    async def _emit(self, delta: common_pb2.SequenceDelta) -> None:
        self.out.add(delta)
        if delta.token_ids and not self.ttft_ms:
            self.ttft_ms = (time.monotonic() - self.req.received_at) * 1000
        if self.req.stream:
            self.sent = True
            await self._send(router_pb2.GenerateResponse(delta=delta))

    async def _send_prompt_logprobs(self, entries: Iterable[common_pb2.TokenLogprob]) -> None:
        """A streamed request that asked for prompt logprobs gets them once, before its first
        delta, from whichever instance computed the prompt first (a re-routed or migrated
        decode computes them again: those are not sent)."""
        if not self.req.stream or self.prompt_logprobs_sent or \
                not self.req.sampling.HasField("prompt_logprobs"):
            return
        self.prompt_logprobs_sent = True
        await self._send(router_pb2.GenerateResponse(
            prompt_logprobs=common_pb2.PromptLogprobs(entries=entries)))

    def _served_by(self) -> router_pb2.ServedBy:
        decode_id = self.plan.decode.instance_id
        prefill_id = self.plan.prefill.instance_id if self.plan.prefill else decode_id
        return router_pb2.ServedBy(prefill_instance_id=prefill_id, decode_instance_id=decode_id)

    async def _finish(
        self, usage: common_pb2.Usage, prompt_logprobs: list[common_pb2.TokenLogprob]
    ) -> None:
        if not self.req.stream:
            for delta in self.out.collapsed():
                await self._send(router_pb2.GenerateResponse(delta=delta))
        result = router_pb2.GenerateResult(
            request_id=self.req.request_id,
            usage=usage,
            prompt_logprobs=prompt_logprobs,
            timing=_merge_timing(self.req, self.ttft_ms, self.timings),
            served_by=self._served_by(),
        )
        self._observe(result)
        await self._send(router_pb2.GenerateResponse(result=result))

    def _observe(self, result: router_pb2.GenerateResult) -> None:
        """Router metrics and the generate span's response attributes for one request."""
        m = self.orch.metrics
        usage, timing = result.usage, result.timing
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.cached_prompt_tokens.inc(usage.cached_prompt_tokens)
        m.generation_tokens.inc(usage.completion_tokens)
        e2e_s = timing.e2e_ms / 1e3
        m.e2e.observe(e2e_s)
        if self.ttft_ms:
            m.ttft.observe(self.ttft_ms / 1e3)
            if usage.completion_tokens > 1:
                m.tpot.observe((e2e_s - self.ttft_ms / 1e3) / (usage.completion_tokens - 1))
        span = trace.get_current_span()
        if not span.is_recording():
            return
        finishes = [_finish_name(s.finish.reason) for s in self.out.sequences if s.finish]
        span.set_attributes(gen_ai_response_attributes(
            response_id=result.request_id, output_tokens=usage.completion_tokens,
            finish_reasons=finishes, input_tokens=usage.prompt_tokens,
        ))
        span.set_attributes({
            "pdmesh.cached_prompt_tokens": usage.cached_prompt_tokens,
            "pdmesh.ttft_ms": self.ttft_ms,
            "pdmesh.e2e_ms": timing.e2e_ms,
            "pdmesh.decode.instance_id": result.served_by.decode_instance_id,
            "pdmesh.prefill.instance_id": result.served_by.prefill_instance_id,
        })

    async def execute(self) -> None:
        remote: engine_pb2.RemotePrefill | None = None
        if self.plan.prefill is not None:
            remote = await self._prefill_rerouting()
            # None with no prefill instance left in the plan: the decode instance prefills.
            if remote is None and self.plan.prefill is not None:
                # every sequence finished on the prefill instance
                assert self.prefill_resp is not None
                usage = common_pb2.Usage(
                    prompt_tokens=len(self.req.prompt_token_ids),
                    completion_tokens=self.out.completion_tokens,
                    cached_prompt_tokens=self.prefill_resp.cached_prompt_tokens,
                )
                await self._finish(usage, list(self.prefill_resp.prompt_logprobs))
                return
        await self._decode_rerouting(remote)

    # -- re-routing --------------------------------------------------------------------------
    def _reroute(self, role: str, failed: Instance, unreached: _Unreached) -> Instance:
        """Another instance of `role` for a call `failed` never served; RouteError (the
        failure, UNAVAILABLE, or DEADLINE_EXCEEDED) when there is none or no time left."""
        self.tried.add(failed.address)
        self.req.remaining_s()
        try:
            chosen = self.orch._choose(role, self.plan.route, self.plan.lookup,
                                       exclude=frozenset(self.tried))
        except RouteError:
            raise RouteError(
                grpc.StatusCode.UNAVAILABLE, f"{unreached.error}; no other {role} instance left"
            ) from None
        self.orch.metrics.reroutes.labels(role, unreached.reason).inc()
        trace.get_current_span().add_event("pdmesh.reroute", {
            "pdmesh.role": role, "pdmesh.reroute.from": failed.address,
            "pdmesh.reroute.to": chosen.address, "pdmesh.reroute.reason": unreached.reason,
        })
        logger.info("re-routed request_id=%s role=%s from=%s to=%s reason=%s",
                    self.req.request_id, role, failed.address, chosen.address, unreached.reason)
        self._slots[role].move(chosen)
        return chosen

    async def _prefill_rerouting(self) -> engine_pb2.RemotePrefill | None:
        """Prefill, on another prefill instance when the chosen one cannot be reached or fails
        with an instance fault, and on the decode instance itself (local prefill) when no
        prefill instance is left: then `plan.prefill` becomes None and so does the result.
        Nothing has gone to the client before the Prefill answer, so every retry is clean; the
        request's deadline bounds them."""
        while True:
            instance = self.plan.prefill
            assert instance is not None
            try:
                return await self._prefill(instance)
            except _Unreached as unreached:
                failure = unreached
            try:
                self.plan.prefill = self._reroute("prefill", instance, failure)
            except RouteError as final:
                if final.code != grpc.StatusCode.UNAVAILABLE:  # deadline exceeded
                    raise
                self._prefill_locally(instance, failure)
                return None

    def _prefill_locally(self, failed: Instance, failure: _Unreached) -> None:
        """No prefill instance is left for this request: its decode instance prefills."""
        decode = self.plan.decode
        self.plan.prefill = None
        self._slots["prefill"].move(None)
        self.orch.metrics.reroutes.labels("prefill", failure.reason).inc()
        trace.get_current_span().add_event("pdmesh.reroute", {
            "pdmesh.role": "prefill", "pdmesh.reroute.from": failed.address,
            "pdmesh.reroute.to": decode.address, "pdmesh.reroute.reason": failure.reason,
            "pdmesh.reroute.local_prefill": True,
        })
        logger.info("prefill falls back to the decode instance request_id=%s from=%s to=%s "
                    "reason=%s", self.req.request_id, failed.address, decode.address,
                    failure.reason)

    async def _decode_rerouting(self, remote: engine_pb2.RemotePrefill | None) -> None:
        """Decode, on another decode instance when the chosen one cannot be reached before it
        sent anything. The prefill's first tokens may already be with the client: the next
        instance gets the same RemotePrefill (KV handle and first tokens) and continues after
        them. Without a remote prefill the next instance prefills locally. A stream that
        breaks later migrates (`_migrate`): the next instance resumes every sequence after
        what the router already holds."""
        resume: list[engine_pb2.ResumedSequence] = []
        while True:
            instance = self.plan.decode
            try:
                await self._decode(instance, remote, resume)
                return
            except _Unreached as unreached:
                failure = unreached
            except _Broken as broken:
                if all(s.finish is not None for s in self.out.sequences):
                    await self._finish(self._usage(None), self._prompt_logprobs(None))
                    return  # only the final result was lost
                chosen = self._migrate(instance, broken)
                if chosen is None:
                    if not self.sent:
                        raise broken.error from None
                    await self._fail_after_output(str(broken.error))
                    return
                self.plan.decode = chosen
                remote = None  # its KV was released; the next instance prefills itself
                resume = self._resume_state() if self.out.started else []
                continue
            try:
                self.plan.decode = self._reroute("decode", instance, failure)
            except RouteError as final:
                if remote is not None and self.plan.prefill is not None:
                    self.orch.spawn(self._release_kv(
                        self.plan.prefill, remote.kv.transfer_id, "no decode instance left"))
                if not self.sent:
                    raise
                await self._fail_after_output(str(final))
                return

    def _migrate(self, failed: Instance, broken: _Broken) -> Instance | None:
        """Another decode instance to resume a broken stream on; None when migration is off or
        spent, the deadline has passed, or no other decode instance is left."""
        self.tried.add(failed.address)
        if self.migrations >= self.orch.migration_limit:
            logger.info("not migrating request_id=%s: migration limit %d reached (%s)",
                        self.req.request_id, self.orch.migration_limit, broken.reason)
            return None
        if self.req.deadline <= time.monotonic():
            return None
        try:
            chosen = self.orch._choose("decode", self.plan.route, self.plan.lookup,
                                       exclude=frozenset(self.tried))
        except RouteError:
            logger.info("not migrating request_id=%s: no other decode instance left",
                        self.req.request_id)
            return None
        self.migrations += 1
        produced = self.out.completion_tokens
        self.orch.metrics.migrations.labels(broken.reason).inc()
        trace.get_current_span().add_event("pdmesh.migration", {
            "pdmesh.migration.from": failed.address, "pdmesh.migration.to": chosen.address,
            "pdmesh.migration.reason": broken.reason, "pdmesh.migration.attempt": self.migrations,
            "pdmesh.migration.tokens_so_far": produced,
        })
        logger.info("migrated request_id=%s from=%s to=%s reason=%s tokens_so_far=%d",
                    self.req.request_id, failed.address, chosen.address, broken.reason, produced)
        self._slots["decode"].move(chosen)
        return chosen

    def _resume_state(self) -> list[engine_pb2.ResumedSequence]:
        """Everything the router holds of each sequence: what the next instance continues."""
        return [
            engine_pb2.ResumedSequence(index=index, token_ids=seq.token_ids,
                                       text="".join(seq.text), finished=seq.finish is not None)
            for index, seq in enumerate(self.out.sequences)
        ]

    def _usage(self, result: engine_pb2.DecodeResult | None) -> common_pb2.Usage:
        """The request's usage after a migration, as an undisturbed run reports it: the
        original prompt, every token produced, the original prefill's cached tokens."""
        if self.prefill_resp is not None:
            cached = self.prefill_resp.cached_prompt_tokens
        else:
            cached = result.usage.cached_prompt_tokens if result is not None else 0
        return common_pb2.Usage(
            prompt_tokens=len(self.req.prompt_token_ids),
            completion_tokens=self.out.completion_tokens,
            cached_prompt_tokens=cached,
        )

    def _prompt_logprobs(
        self, result: engine_pb2.DecodeResult | None
    ) -> list[common_pb2.TokenLogprob]:
        if self.prefill_resp is not None:
            return list(self.prefill_resp.prompt_logprobs)
        return list(result.prompt_logprobs) if result is not None else []

    # -- prefill -----------------------------------------------------------------------------
    async def _prefill(self, instance: Instance) -> engine_pb2.RemotePrefill | None:
        req = self.req
        message = engine_pb2.PrefillRequest(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
            cache_salt=req.cache_salt,
            priority=req.priority,
        )
        try:
            resp = await instance.prefill_stub().Prefill(
                message, timeout=req.remaining_s(), metadata=inject_metadata()
            )
        except asyncio.CancelledError:
            if cancelled_from_outside():
                self.orch.spawn(self._abort_prefill(instance, "client cancelled"))
                raise
            self.orch.spawn(self._abort_prefill(instance, "re-routed"))
            message_text = f"prefill call to {instance.address} was cancelled (channel closed)"
            raise _Unreached(RouteError(grpc.StatusCode.UNAVAILABLE, message_text),
                             "channel_closed") from None
        except grpc.aio.AioRpcError as exc:
            error = self._instance_error(instance, "prefill", exc)
            reason = unreached_reason(exc) or _fault_reason(exc)
            if reason is not None:  # nothing went to the client yet: another instance may
                self.orch.spawn(self._abort_prefill(instance, "re-routed"))
                raise _Unreached(error, reason) from None
            raise error from None
        self.prefill_resp = resp
        self.timings.append(resp.timing)
        try:
            await self._send_prompt_logprobs(resp.prompt_logprobs)
            for delta in resp.first:
                await self._emit(delta)
        except BaseException:
            if resp.HasField("kv"):
                self.orch.spawn(self._release_kv(instance, resp.kv.transfer_id, "client gone"))
            raise
        if not resp.HasField("kv"):
            return None
        return engine_pb2.RemotePrefill(
            kv=resp.kv, first=resp.first, cached_prompt_tokens=resp.cached_prompt_tokens
        )

    # -- decode ------------------------------------------------------------------------------
    def _granted(self, remote: engine_pb2.RemotePrefill | None,
                 instance: Instance) -> engine_pb2.RemotePrefill | None:
        """`remote` with a capability for `instance` alone (with a cluster token): the sender
        serves the KV only to its holder (kvstore/transfer/capability.py)."""
        token = self.orch.token
        if remote is None or token is None:
            return remote
        granted = engine_pb2.RemotePrefill()
        granted.CopyFrom(remote)
        granted.capability.CopyFrom(TransferCapability.mint(
            token, remote.kv.transfer_id, instance.instance_id).to_proto())
        return granted

    async def _decode(
        self, instance: Instance, remote: engine_pb2.RemotePrefill | None,
        resume: list[engine_pb2.ResumedSequence],
    ) -> None:
        """One Decode call, streamed through. Raises _Unreached (re-route it) or _Broken
        (migrate it) for an instance's failure; fails the request for any other."""
        req = self.req
        message = engine_pb2.DecodeRequest(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
            cache_salt=req.cache_salt,
            priority=req.priority,
            remote_prefill=self._granted(remote, instance),
            resume=resume,
        )
        result: engine_pb2.DecodeResult | None = None
        answered = False  # the instance sent something: the call can no longer be re-routed
        call = instance.decode_stub().Decode(
            message, timeout=req.remaining_s(), metadata=inject_metadata()
        )
        try:
            async for resp in call:
                answered = True
                if resp.HasField("delta"):
                    await self._emit(resp.delta)
                elif resp.HasField("result"):
                    result = resp.result
                elif resp.HasField("prompt_logprobs"):
                    await self._send_prompt_logprobs(resp.prompt_logprobs.entries)
        except asyncio.CancelledError:
            call.cancel()
            if cancelled_from_outside():
                self._cleanup_after_decode(instance, remote, "client cancelled")
                raise
            # Not this request's task: the call itself was cancelled under it (its channel
            # closed). The stream broke on this side; the instance may be fine.
            self._cleanup_after_decode(instance, remote, "decode call cancelled")
            message_text = f"decode call to {instance.address} was cancelled (channel closed)"
            raise _Broken(RouteError(grpc.StatusCode.UNAVAILABLE, message_text),
                          "channel_closed") from None
        except grpc.aio.AioRpcError as exc:
            if refused_reason(exc) == KV_LOAD_FAILED:  # the prefill instance's fault
                error = self._kv_load_failed(exc)
                self._cleanup_after_decode(instance, remote, "KV load failed")
                if not self.sent:
                    raise error from None
                await self._fail_after_output(str(error))
                return
            error = self._instance_error(instance, "decode", exc)
            reason = unreached_reason(exc)
            if not answered and reason is not None:
                # The KV stays leased for the next decode instance; only this one forgets it.
                self.orch.spawn(self._abort(instance.decode_stub().Abort, instance, "re-routed"))
                raise _Unreached(error, reason) from None
            self._cleanup_after_decode(instance, remote, f"decode failed: {exc.code().name}")
            if exc.code() in _INSTANCE_FAULTS:
                raise _Broken(error, broken_reason(exc)) from None
            if not self.sent:
                raise error from None
            await self._fail_after_output(str(error))
            return
        except BaseException:
            call.cancel()
            self._cleanup_after_decode(instance, remote, "router error")
            raise
        if result is None:
            self._cleanup_after_decode(instance, remote, "decode stream ended without a result")
            message_text = f"decode instance {instance.address} ended without a result"
            raise _Broken(RouteError(grpc.StatusCode.UNAVAILABLE, message_text), "no_result")
        self.timings.append(result.timing)
        if result.kv_load_fallback:  # recomputed on decode: still the prefill's fault
            self._charge_kv_load_failure(result.kv_load_fallback)
            if remote is not None and self.plan.prefill is not None:  # never pulled: free it
                self.orch.spawn(self._release_kv(self.plan.prefill, remote.kv.transfer_id,
                                                 "KV load failed; recomputed on decode"))
        usage = self._usage(result) if self.migrations else result.usage
        await self._finish(usage, self._prompt_logprobs(result))

    async def _fail_after_output(self, message: str) -> None:
        for delta in self.out.fail_unfinished(message):
            if self.req.stream:
                await self._send(router_pb2.GenerateResponse(delta=delta))
        cached = self.prefill_resp.cached_prompt_tokens if self.prefill_resp else 0
        usage = common_pb2.Usage(
            prompt_tokens=len(self.req.prompt_token_ids),
            completion_tokens=self.out.completion_tokens,
            cached_prompt_tokens=cached,
        )
        prompt_logprobs = list(self.prefill_resp.prompt_logprobs) if self.prefill_resp else []
        await self._finish(usage, prompt_logprobs)

    # -- failures and cleanup ----------------------------------------------------------------
    def _instance_error(
        self, instance: Instance, what: str, exc: grpc.aio.AioRpcError
    ) -> RouteError:
        code = exc.code()
        if code in _INSTANCE_FAULTS:
            self.orch.pool.mark_failed(instance, f"{what} failed: {code.name} {exc.details()}")
        where = f"{what} instance {instance.instance_id or '?'} at {instance.address}"
        message = f"{where} failed: {code.name}: {exc.details()}"
        if code in _PASS_THROUGH:
            return RouteError(code, message)
        return RouteError(grpc.StatusCode.UNAVAILABLE, message)

    def _kv_load_failed(self, exc: grpc.aio.AioRpcError) -> RouteError:
        """A decode instance refused the request because it could not pull its KV
        (`--kv-load-failure-policy fail`): the prefill instance is charged, the decode
        instance stays routable."""
        self._charge_kv_load_failure(exc.details() or "KV load failed")
        return RouteError(grpc.StatusCode.UNAVAILABLE,
                          f"decode instance could not load the KV cache: {exc.details()}")

    def _charge_kv_load_failure(self, reason: str) -> None:
        """The KV the prefill instance published could not be pulled: its fault, so it leaves
        routing until a poll succeeds (a dead or stopped one stays out)."""
        prefill = self.plan.prefill
        if prefill is None:
            return
        self.orch.pool.mark_failed(prefill, f"KV pull from it failed: {reason}")
        trace.get_current_span().add_event("pdmesh.kv_load_failed", {
            "pdmesh.prefill.address": prefill.address, "pdmesh.kv.failure_reason": reason,
        })

    def _cleanup_after_decode(
        self, decode: Instance, remote: engine_pb2.RemotePrefill | None, reason: str
    ) -> None:
        self.orch.spawn(self._abort(decode.decode_stub().Abort, decode, reason))
        if remote is not None and self.plan.prefill is not None:
            self.orch.spawn(self._release_kv(self.plan.prefill, remote.kv.transfer_id, reason))

    async def _release_kv(self, instance: Instance, transfer_id: str, reason: str) -> None:
        request = engine_pb2.ReleaseKVRequest(
            request_id=self.req.request_id, transfer_id=transfer_id, reason=reason
        )
        try:
            await instance.prefill_stub().ReleaseKV(request, timeout=self.orch.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.info("ReleaseKV on %s failed: %s", instance.address, exc.code().name)
        except grpc.aio.UsageError:  # the instance left and its channel closed: lease expires
            logger.info("ReleaseKV on %s skipped: its channel is closed", instance.address)

    async def _abort_prefill(self, instance: Instance, reason: str) -> None:
        await self._abort(instance.prefill_stub().Abort, instance, reason)

    async def _abort(self, method: Any, instance: Instance, reason: str) -> None:
        request = engine_pb2.AbortRequest(request_id=self.req.request_id, reason=reason)
        try:
            await method(request, timeout=self.orch.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.debug("Abort on %s failed: %s", instance.address, exc.code().name)
        except grpc.aio.UsageError:  # the instance left and its channel closed
            logger.debug("Abort on %s skipped: its channel is closed", instance.address)
