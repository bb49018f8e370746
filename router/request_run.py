"""The run of one request: prefill (maybe remotely), then decode, streamed back.

With a prefill instance in the plan, Prefill runs there, its first tokens go to the client at
once, and Decode continues with the KV handle; the decode instance pulls the KV straight from
the prefill instance. Without one, the decode instance prefills locally and no KV moves.

Every Prefill call and Decode stream runs under a progress watchdog (router/watchdog.py):
once the call and its instance have both shown no progress for the instance's stall bound,
the call is cancelled, the instance leaves routing (`mark_failed`; it comes back once a poll
finds its core answering again) and the request moves as after a crash. A failed call is
classified (router/failures.py) and re-routed or migrated (router/recovery.py); a failing
instance leaves routing at once. A failed KV pull is the prefill instance's fault, charged
there, never to the decode instance: the decode instance either recomputed the prompt
(`DecodeResult.kv_load_fallback`) or refused with `kv_load_failed` (UNAVAILABLE before
output, an error finish after).

Before any output a failure is a status (`RouteError`); after output, unfinished sequences end
with FINISH_REASON_ERROR and the stream still ends with a GenerateResult. With stream=false
nothing is sent before the end, so every failure is a status. A cancelled client call
cancels the Decode stream and releases the prefill side's KV, so every block comes back.

Streamed by chunk (`--kv-stream-chunks`, the default), the run delegates its prefill to
router/streamed_prefill.py (`PrefillStream`, with Decode started while the prompt computes);
an instance that cannot stream is asked `Prefill` as above. Each Decode call is a
router/decode_call.py `DecodeCall`, which turns how it ended into what the loops here do next.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from pdmesh.auth import ClusterToken
from pdmesh.metrics import RouterMetrics
from pdmesh.router.cleanup import CleanupCalls
from pdmesh.router.decode_call import DecodeCall
from pdmesh.router.failures import (
    Broken,
    RouteError,
    Unreached,
    cancelled_from_outside,
    cancelled_under_us,
    fault_reason,
    instance_error,
    is_instance_fault,
    stalled_error,
    unreached_reason,
)
from pdmesh.router.instance import Instance
from pdmesh.router.instances import InstancePool
from pdmesh.router.load_slots import LoadSlots
from pdmesh.router.peer_prefix import Loan, PeerPrefixes
from pdmesh.router.planner import Planner
from pdmesh.router.recovery import Recovery, resume_state
from pdmesh.router.request import Plan, PreparedRequest
from pdmesh.router.responses import (
    ResponseStream,
    final_prompt_logprobs,
    final_usage,
    served_by,
)
from pdmesh.router.streamed_prefill import StreamedPrefill
from pdmesh.router.watchdog import CallWatch
from pdmesh.tracing import inject_metadata
from pdmesh.v1 import engine_pb2

Remote = engine_pb2.RemotePrefill | None


@dataclass(frozen=True)
class RunContext:
    """What every request's run shares."""

    pool: InstancePool
    planner: Planner
    cleanup: CleanupCalls
    metrics: RouterMetrics
    migration_limit: int
    token: ClusterToken | None  # binds each KV handle to the decode instance it is sent to
    stream_kv: bool = True  # PrefillStream: the KV moves while the prompt is computed
    peers: PeerPrefixes | None = None  # cluster-wide prefix caching (peer_prefix.py)


class RequestRun:
    """The state of one request while it runs (kept off the shared Orchestrator)."""

    def __init__(self, ctx: RunContext, req: PreparedRequest, plan: Plan,
                 responses: ResponseStream, slots: LoadSlots) -> None:
        self.ctx = ctx
        self.req = req
        self.plan = plan
        self.responses = responses
        self.recovery = Recovery(req, plan, slots, ctx.planner, ctx.metrics,
                                 ctx.migration_limit)
        self.prefill_resp: engine_pb2.PrefillResponse | None = None
        self.superseded = False  # a streamed Decode call being stopped: no cleanup abort
        self.peer_reused = False  # a peer's prefix was pulled: the index's prediction is moot

    async def execute(self) -> None:
        remote: Remote = None
        if (self.plan.prefill is not None and self.ctx.stream_kv
                and await StreamedPrefill(self).execute()):
            return
        if self.plan.prefill is not None:
            remote = await self.prefill_rerouting()
            # None with no prefill instance left in the plan: the decode instance prefills.
            if remote is None and self.plan.prefill is not None:
                # every sequence finished on the prefill instance
                assert self.prefill_resp is not None
                await self.finish()
                return
        await self.decode_rerouting(remote)

    async def finish(self, result: engine_pb2.DecodeResult | None = None) -> None:
        """The final message. A decode result's own usage stands unless the stream migrated;
        otherwise usage is the undisturbed run's (responses.final_usage)."""
        # The index's prefix prediction for the instance that computed the prompt, checked
        # against its report (router/prefix_predictions.py); a moved run is left out.
        self.ctx.planner.predictions.check(
            self.req, self.plan, self.prefill_resp, result,
            moved=bool(self.recovery.tried) or self.recovery.migrations > 0
            or self.peer_reused)
        if result is not None and not self.recovery.migrations:
            usage = result.usage
        else:
            usage = final_usage(self.req, self.responses.out.completion_tokens,
                                self.prefill_resp, result)
        await self.responses.finish(usage, final_prompt_logprobs(self.prefill_resp, result),
                                    served_by(self.plan))

    # -- a peer's prefix (router/peer_prefix.py) ---------------------------------------------
    async def lend_prefix(self, target: Instance, *, offer: bool = True
                          ) -> tuple[Loan | None, float]:
        """The leading prompt blocks another instance holds beyond `target`'s own, lent for
        `target` to pull when the cost model says so (None: it computes them), and the
        timeout of the call that carries them: a deadline that passed meanwhile releases the
        loan before the RouteError goes up, so no loan outlives its call unsent."""
        peers = self.ctx.peers
        loan = None
        if peers is not None and offer:
            live = {i.instance_id: i for role in ("prefill", "decode")
                    for i in self.ctx.pool.routable(role)}
            loan = await peers.offer(self.req, self.plan.lookup, target, live.values(),
                                     self.plan.route.block_size)
        try:
            return loan, self.req.remaining_s()
        except BaseException:
            self.prefix_unused(loan, "deadline exceeded")
            raise

    def prefix_pulled(self, loan: Loan | None,
                      result: engine_pb2.PeerPrefixResult | None) -> None:
        """The call that carried `loan` answered: how its pull went."""
        if loan is None or self.ctx.peers is None:
            return
        self.ctx.peers.observe(loan, result)
        if result is not None and result.blocks_pulled and not result.fallback:
            self.peer_reused = True

    def prefix_unused(self, loan: Loan | None, reason: str) -> None:
        """The call that carried `loan` failed or never went: the lender drops it (a pull
        its target had started was ended by the target)."""
        if loan is not None:
            self.ctx.cleanup.release_prefix(loan.lender, loan.loan_id,
                                            loan.peer.kv.transfer_id, reason)

    async def fail_after_output(self, message: str) -> None:
        """Output went to the client: its unfinished sequences end with an error finish."""
        await self.responses.fail_unfinished(message)
        await self.finish()

    # -- recovery loops ----------------------------------------------------------------------
    async def prefill_rerouting(self) -> Remote:
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
            except Unreached as unreached:
                failure = unreached
            try:
                self.recovery.reroute("prefill", instance, failure)
            except RouteError as final:
                if final.code != grpc.StatusCode.UNAVAILABLE:  # deadline exceeded
                    raise
                self.recovery.prefill_locally(instance, failure)
                return None

    async def decode_rerouting(self, remote: Remote,
                                started: asyncio.Future[None] | None = None) -> None:
        """Decode, on another decode instance when the chosen one cannot be reached before it
        sent anything. The prefill's first tokens may already be with the client: the next
        instance gets the same RemotePrefill (KV handle and first tokens) and continues after
        them. Without a remote prefill the next instance prefills locally. A stream that
        breaks later migrates: the next instance resumes every sequence after what the router
        already holds. `started`: the first attempt, already running (a streamed prefill's
        Decode call)."""
        out = self.responses.out
        resume: list[engine_pb2.ResumedSequence] = []
        while True:
            instance = self.plan.decode
            try:
                if started is not None:
                    attempt, started = started, None
                    await attempt
                else:
                    await self.decode(instance, remote, resume)
                return
            except Unreached as unreached:
                failure = unreached
            except Broken as broken:
                if out.finished:
                    await self.finish()
                    return  # only the final result was lost
                if self.recovery.migrate(instance, broken, out.completion_tokens) is None:
                    if not self.responses.sent:
                        raise broken.error from None
                    await self.fail_after_output(str(broken.error))
                    return
                remote = None  # its KV was released; the next instance prefills itself
                resume = resume_state(out) if out.started else []
                continue
            try:
                self.recovery.reroute("decode", instance, failure)
            except RouteError as final:
                if remote is not None and self.plan.prefill is not None:
                    self.ctx.cleanup.release_kv(self.plan.prefill, self.req.request_id,
                                                remote.kv.transfer_id, "no decode instance left")
                if not self.responses.sent:
                    raise
                await self.fail_after_output(str(final))
                return

    # -- prefill -----------------------------------------------------------------------------
    async def _prefill(self, instance: Instance) -> Remote:
        """One Prefill call; its first tokens go to the client. Raises Unreached (re-route
        it) for an instance's failure, RouteError for an answer about the request."""
        req = self.req
        loan, timeout = await self.lend_prefix(instance)
        message = engine_pb2.PrefillRequest(
            **req.engine_fields(), peer_prefix=loan.peer if loan is not None else None)
        call = instance.prefill_stub().Prefill(message, timeout=timeout,
                                               metadata=inject_metadata())
        watch = CallWatch(self.ctx.pool, instance, call.cancel, "prefill")
        try:
            try:
                async with watch:
                    resp = await call
            except BaseException:
                self.prefix_unused(loan, "prefill call failed")
                raise
        except asyncio.CancelledError:
            call.cancel()
            if cancelled_from_outside():
                self.abort(instance, "prefill", "client cancelled")
                raise
            self.abort(instance, "prefill", "re-routed")
            if watch.fired:  # nothing reached the client yet: another path takes it
                raise Unreached(self.stalled(instance, "prefill", watch), "stalled") from None
            raise Unreached(cancelled_under_us(instance, "prefill"), "channel_closed") from None
        except grpc.aio.AioRpcError as exc:
            error = self.failed(instance, "prefill", exc)
            reason = unreached_reason(exc) or fault_reason(exc)
            if reason is not None:  # nothing went to the client yet: another instance may
                self.abort(instance, "prefill", "re-routed")
                raise Unreached(error, reason) from None
            raise error from None
        self.prefill_resp = resp
        self.prefix_pulled(loan, resp.peer_prefix if resp.HasField("peer_prefix") else None)
        self.responses.timings.append(resp.timing)
        try:
            await self.responses.send_prompt_logprobs(resp.prompt_logprobs)
            for delta in resp.first:
                await self.responses.emit(delta)
        except BaseException:
            if resp.HasField("kv"):
                self.ctx.cleanup.release_kv(instance, req.request_id, resp.kv.transfer_id,
                                            "client gone")
            raise
        if not resp.HasField("kv"):
            return None
        return engine_pb2.RemotePrefill(
            kv=resp.kv, first=resp.first, cached_prompt_tokens=resp.cached_prompt_tokens
        )

    # -- decode ------------------------------------------------------------------------------
    async def decode(
        self, instance: Instance, remote: Remote, resume: list[engine_pb2.ResumedSequence],
    ) -> None:
        """One Decode call (router/decode_call.py). Raises Unreached (re-route it) or Broken
        (migrate it) for an instance's failure; fails the request for any other."""
        await DecodeCall(self, instance, remote, resume).execute()

    # -- failures and cleanup ----------------------------------------------------------------
    def failed(self, instance: Instance, what: str, exc: grpc.aio.AioRpcError) -> RouteError:
        """What a failed call means to the client; an instance at fault leaves routing."""
        if is_instance_fault(exc):
            self.ctx.pool.mark_failed(
                instance, f"{what} failed: {exc.code().name} {exc.details()}")
        return instance_error(instance, what, exc)

    def stalled(self, instance: Instance, what: str, watch: CallWatch) -> RouteError:
        """A call on `instance` fired its progress watchdog: the instance leaves routing (a
        poll that finds its core answering brings it back)."""
        quiet = watch.fired_after_s or 0.0
        self.ctx.pool.mark_failed(instance, f"{what} call made no progress for {quiet:.1f}s")
        return stalled_error(instance, what, quiet)

    def abort(self, instance: Instance, role: str, reason: str) -> None:
        self.ctx.cleanup.abort(instance, role, self.req.request_id, reason)
