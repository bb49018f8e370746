"""One Decode call of a request's run: streamed through to the client, and what its end means.

The decode instance continues after the prefill's first tokens (`remote`: the KV handle it
pulls), resumes sequences a broken stream left (`resume`), or prefills the prompt itself. How
the call ends decides what the run does next:

- a result: the request finishes (a KV pull that fell back to recompute is still charged to
  the prefill instance, and its unpulled export released);
- a status before the instance sent anything, of a kind that says it was never reached:
  `Unreached`, and the run re-routes the call (the KV stays leased for the next instance);
- an instance fault, a stall (the progress watchdog, router/watchdog.py) or a cancelled
  channel: `Broken`, and the run migrates the request's sequences;
- `kv_load_failed` (`--kv-load-failure-policy fail`): the prefill instance's fault, never the
  decode instance's;
- anything else: the request fails (a status before output, error finishes after).

Every end that leaves work behind aborts the decode side and releases the prefill side's KV,
except a streamed Decode call the streamed path stopped itself (`RequestRun.superseded`).

A part of the request's run (router/request_run.py), which it delegates to, as
router/streamed_prefill.py does.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace

from pdmesh.auth import ClusterToken
from pdmesh.grpc_common import KV_LOAD_FAILED, refused_reason
from pdmesh.kvstore.transfer.capability import TransferCapability
from pdmesh.router.failures import (
    Broken,
    RouteError,
    Unreached,
    broken_reason,
    cancelled_from_outside,
    cancelled_under_us,
    is_instance_fault,
    unreached_reason,
)
from pdmesh.router.instance import Instance
from pdmesh.router.watchdog import CallWatch
from pdmesh.tracing import inject_metadata
from pdmesh.v1 import engine_pb2

if TYPE_CHECKING:
    from pdmesh.router.request_run import Remote, RequestRun


def granted(remote: Remote, token: ClusterToken | None, instance: Instance) -> Remote:
    """`remote` with a capability for `instance` alone (with a cluster token): the sender
    serves the KV only to its holder (kvstore/transfer/capability.py)."""
    if remote is None or token is None:
        return remote
    grant = engine_pb2.RemotePrefill()
    grant.CopyFrom(remote)
    grant.capability.CopyFrom(TransferCapability.mint(
        token, remote.kv.transfer_id, instance.instance_id).to_proto())
    return grant


class DecodeCall:
    """One Decode call on `instance` for `run` (module docstring)."""

    def __init__(self, run: RequestRun, instance: Instance, remote: Remote,
                 resume: list[engine_pb2.ResumedSequence]) -> None:
        self.run = run
        self.instance = instance
        self.remote = remote
        self.resume = resume

    async def execute(self) -> None:
        """The call, streamed through. Raises Unreached (re-route it) or Broken (migrate it)
        for an instance's failure; fails the request for any other."""
        run, instance, remote = self.run, self.instance, self.remote
        req = run.req
        # Prefilled there: its leading blocks perhaps lent by a peer.
        loan, timeout = await run.lend_prefix(instance,
                                              offer=remote is None and not self.resume)
        message = engine_pb2.DecodeRequest(
            **req.engine_fields(),
            remote_prefill=granted(remote, run.ctx.token, instance),
            resume=self.resume,
            peer_prefix=loan.peer if loan is not None else None,
        )
        result: engine_pb2.DecodeResult | None = None
        answered = False  # the instance sent something: the call can no longer be re-routed
        call = instance.decode_stub().Decode(message, timeout=timeout,
                                             metadata=inject_metadata())
        watch = CallWatch(run.ctx.pool, instance, call.cancel, "decode")
        try:
            try:
                async with watch:
                    async for resp in call:
                        answered = True
                        watch.progressed()
                        if resp.HasField("delta"):
                            await run.responses.emit(resp.delta)
                        elif resp.HasField("result"):
                            result = resp.result
                        elif resp.HasField("prompt_logprobs"):
                            await run.responses.send_prompt_logprobs(
                                resp.prompt_logprobs.entries)
            except BaseException:
                run.prefix_unused(loan, "decode call failed")
                raise
        except asyncio.CancelledError:
            call.cancel()
            if cancelled_from_outside():
                self._cleanup("client cancelled")
                raise
            if watch.fired:  # hung: migrate, as after a crash
                self._cleanup("no progress")
                raise Broken(run.stalled(instance, "decode", watch), "stalled") from None
            # Not this request's task: the call itself was cancelled under it (its channel
            # closed). The stream broke on this side; the instance may be fine.
            self._cleanup("decode call cancelled")
            raise Broken(cancelled_under_us(instance, "decode"), "channel_closed") from None
        except grpc.aio.AioRpcError as exc:
            await self._failed(exc, answered)
            return
        except BaseException:
            call.cancel()
            self._cleanup("router error")
            raise
        if result is None:
            self._cleanup("decode stream ended without a result")
            message_text = f"decode instance {instance.address} ended without a result"
            raise Broken(RouteError(grpc.StatusCode.UNAVAILABLE, message_text), "no_result")
        run.responses.timings.append(result.timing)
        run.prefix_pulled(loan, result.peer_prefix if result.HasField("peer_prefix") else None)
        if result.kv_load_fallback:  # recomputed on decode: still the prefill's fault
            self._charge_kv_load_failure(result.kv_load_fallback)
            if remote is not None and run.plan.prefill is not None:  # never pulled: free it
                run.ctx.cleanup.release_kv(run.plan.prefill, req.request_id,
                                           remote.kv.transfer_id,
                                           "KV load failed; recomputed on decode")
        await run.finish(result)

    async def _failed(self, exc: grpc.aio.AioRpcError, answered: bool) -> None:
        """The call ended with a status: re-route it (Unreached) when it never reached a
        working instance, migrate it (Broken) after an instance fault, else fail the request
        (a status before output, error finishes after)."""
        run, instance = self.run, self.instance
        if refused_reason(exc) == KV_LOAD_FAILED:  # the prefill instance's fault
            error = self._kv_load_failed(exc)
            self._cleanup("KV load failed")
            if not run.responses.sent:
                raise error from None
            await run.fail_after_output(str(error))
            return
        error = run.failed(instance, "decode", exc)
        reason = unreached_reason(exc)
        if not answered and reason is not None:
            # The KV stays leased for the next decode instance; only this one forgets it.
            run.abort(instance, "decode", "re-routed")
            raise Unreached(error, reason) from None
        self._cleanup(f"decode failed: {exc.code().name}")
        if is_instance_fault(exc):
            raise Broken(error, broken_reason(exc)) from None
        if not run.responses.sent:
            raise error from None
        await run.fail_after_output(str(error))

    def _kv_load_failed(self, exc: grpc.aio.AioRpcError) -> RouteError:
        """The decode instance refused the request because it could not pull its KV
        (`--kv-load-failure-policy fail`): the prefill instance is charged, the decode
        instance stays routable."""
        self._charge_kv_load_failure(exc.details() or "KV load failed")
        return RouteError(grpc.StatusCode.UNAVAILABLE,
                          f"decode instance could not load the KV cache: {exc.details()}")

    def _charge_kv_load_failure(self, reason: str) -> None:
        """The KV the prefill instance published could not be pulled: its fault, so it leaves
        routing until a poll succeeds (a dead or stopped one stays out)."""
        prefill = self.run.plan.prefill
        if prefill is None:
            return
        self.run.ctx.pool.mark_failed(prefill, f"KV pull from it failed: {reason}")
        trace.get_current_span().add_event("pdmesh.kv_load_failed", {
            "pdmesh.prefill.address": prefill.address, "pdmesh.kv.failure_reason": reason,
        })

    def _cleanup(self, reason: str) -> None:
        """The call ended leaving work behind: the decode side aborts it, the prefill side's
        KV is released."""
        run = self.run
        if run.superseded:
            # A streamed Decode call stopped by the streamed path (router/streamed_prefill.py):
            # its stopper awaits the abort, and the transfer is not this call's to release:
            # either the prefill's own end releases it, or a fresh Decode call takes it over.
            return
        run.abort(self.instance, "decode", reason)
        if self.remote is not None and run.plan.prefill is not None:
            run.ctx.cleanup.release_kv(run.plan.prefill, run.req.request_id,
                                       self.remote.kv.transfer_id, reason)
