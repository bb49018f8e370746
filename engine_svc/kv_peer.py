"""The engine process's KV ends toward its peers: the one KV sender, and cached prefixes lent
and pulled (cluster-wide prefix caching).

Every instance whose engine core lends KV has one `KVPeerPart`, whatever its role:

* its `KVSender` (control plane, leases) is the process's only one: the prefill role publishes
  its exports on it, and the `KVPeer` service publishes *prefix loans* on it;
* `LendPrefix`: the core pins the leading blocks of a prompt it holds in its prefix cache (a
  conversation's earlier turn, prompt and answer, on the decode instance that wrote it) and
  they are published like an export, under a lease, released exactly once (the puller's ack,
  the lease's end, `ReleasePrefix`, drain);
* `PeerPrefixPulls`: a Prefill call (or a Decode call that prefills locally) that brings a
  `PeerPrefix` starts the transfer on the lender's control plane and hands its core the
  source; the core pulls the blocks its own prefix cache lacks before computing the rest of
  the prompt, and its first output says how that went (`settle`). A pull that fails only
  costs the prompt's full computation: tokens never change.

No KV byte passes through this process: the cores move them (kvstore/connector/).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from pdmesh.engine.frontend.core_calls import EngineError
from pdmesh.engine.outputs import RequestOutput
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine_svc.core_source import start_core_pull
from pdmesh.engine_svc.export_layout import export_layout
from pdmesh.engine_svc.service import EngineService
from pdmesh.kvstore.connector.source import KVSource, LoadResult
from pdmesh.kvstore.transfer.capability import TransferCapability
from pdmesh.kvstore.transfer.checksum import parse_algo
from pdmesh.kvstore.transfer.core_pull import CorePulls, Pull
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import KVHandleError, KVTransferError, failure_outcome
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.receiver import KVReceiver, KVReceiverConfig
from pdmesh.kvstore.transfer.sender import KVSender, KVSenderConfig
from pdmesh.kvstore.transfer.state import ReleaseReason
from pdmesh.kvstore.transfer.worker_planes import CoreCache
from pdmesh.metrics import EngineMetrics
from pdmesh.tracing import Span, span_traceparent
from pdmesh.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

SENDER_BACKENDS = ("shm", "tcp")  # what an instance offers by default, preferred first

ReleaseListener = Callable[[str, ReleaseReason], None]

LOAN_LEASE_S = 5.0
"""A loan's lease before its puller starts the transfer (then the puller's heartbeat keeps it):
the router sends the call that carries it at once, so a loan nobody pulls (its LendPrefix
answer lost to a cancelled request, a call that never went) pins the lender's blocks only
this long."""


def core_cache(service: EngineService) -> CoreCache | None:
    """What the KV sender tells receivers about the engine core's own transports."""
    if service.connector is None:
        return None
    info = service.engine.info
    return CoreCache(info.kv_cache_file, info.num_total_blocks, info.kv_block_server,
                     service.connector.grant_secret, info.kv_cache_ipc,
                     info.kv_ucx_server)


def lends_kv(role: str, service: EngineService) -> bool:
    """A prefill or colocated instance always sends (staged, if its core lends nothing); a
    decode instance lends cached prefixes only when its core moves KV itself."""
    return role != "decode" or service.connector is not None


class PeerPrefixPulls:
    """A request's lent prefix on the pulling side: start the transfer, settle it."""

    def __init__(self, service: EngineService, receiver: KVReceiver, metrics: EngineMetrics,
                 fetch_timeout_s: float) -> None:
        self.service = service
        self.pulls = CorePulls(receiver)
        self.metrics = metrics
        self.fetch_timeout_s = fetch_timeout_s

    def check(self, peer: engine_pb2.PeerPrefix, num_prompt_tokens: int) -> KVHandle:
        """The prefix's handle; ValueError (INVALID_ARGUMENT) for one no lender sends."""
        try:
            handle = KVHandle.from_proto(peer.kv)
        except KVHandleError as exc:
            raise ValueError(f"peer_prefix.kv: {exc}") from None
        if not handle.is_export or handle.streamed:
            raise ValueError("peer_prefix.kv: a lent prefix is a whole export")
        if not 0 < handle.layout.num_tokens < num_prompt_tokens:
            raise ValueError(f"peer_prefix.kv: covers {handle.layout.num_tokens} tokens of a "
                             f"{num_prompt_tokens}-token prompt")
        return handle

    async def begin(self, peer: engine_pb2.PeerPrefix, handle: KVHandle,
                    span: Span) -> tuple[KVSource, Pull] | None:
        """Start the transfer on the lender's control plane; None when it cannot start
        (counted as a fallback: the prompt is computed whole)."""
        if self.service.connector is None:
            self.metrics.prefix_fallback("no_connector")
            return None
        capability = (TransferCapability.from_proto(peer.capability)
                      if peer.HasField("capability") else None)
        try:
            return await start_core_pull(
                self.pulls, self.service.engine.info, handle,
                Deadline.after(self.fetch_timeout_s), traceparent=span_traceparent(span),
                capability=capability)
        except KVTransferError as exc:
            reason = failure_outcome(exc)
            self.metrics.prefix_fallback(reason)
            logger.info("lent prefix from %s not pulled (%s): %s", handle.sender_address,
                        reason, exc)
            return None

    def settle(self, pull: Pull, peer: engine_pb2.PeerPrefix, result: LoadResult | None,
               span: Span) -> None:
        """The core reported the prefix's pull (with the request's first output): ack it or
        say why it failed, and count it."""
        if result is None:
            result = LoadResult(error="the engine reported no pull", reason="error")
        self.pulls.finish_soon(pull, nbytes=result.nbytes, error=result.error,
                               reason=result.reason)
        if result.error:
            self.metrics.prefix_fallback(result.reason or "error")
            logger.info("lent prefix from %s failed, computed here: %s",
                        pull.handle.sender_address, result.error)
        else:
            self.metrics.prefix_pulled(peer.instance_id, pulled=result.pulled_blocks,
                                       reused=result.reused_blocks, nbytes=result.nbytes)
            self.service.counters.add_received(result.nbytes)
        if span.is_recording():
            span.set_attributes({"pdmesh.kv.peer_prefix.lender": peer.instance_id,
                                 "pdmesh.kv.peer_prefix.blocks_pulled": result.pulled_blocks,
                                 "pdmesh.kv.peer_prefix.blocks_reused": result.reused_blocks,
                                 "pdmesh.kv.peer_prefix.bytes": result.nbytes,
                                 "pdmesh.kv.peer_prefix.fallback": result.reason
                                 if result.error else ""})

    def abandon(self, pull: Pull, why: str) -> None:
        self.pulls.abandon(pull, why)


def prefix_result(load: LoadResult) -> engine_pb2.PeerPrefixResult:
    """How a request's lent prefix went, for the router (its bandwidth estimate, metrics)."""
    return engine_pb2.PeerPrefixResult(
        blocks_reused=load.reused_blocks, blocks_pulled=load.pulled_blocks, bytes=load.nbytes,
        pull_ms=load.seconds * 1e3, fallback=(load.reason or "error") if load.error else "")


@dataclass
class StartedPrefix:
    """A call's lent prefix whose transfer started: the source its core pulls from."""

    prefixes: PeerPrefixPulls
    peer: engine_pb2.PeerPrefix
    source: KVSource
    pull: Pull

    def settle(self, out: RequestOutput | None, span: Span) -> None:
        """After the request's first output (`out`), or without one (the call failed or was
        cancelled: the transfer is abandoned). Idempotent."""
        if self.pull.ending:
            return
        if out is None:
            self.prefixes.abandon(self.pull, "the call ended before its prefix was pulled")
        else:
            self.prefixes.settle(self.pull, self.peer, out.kv_load, span)


class PrefixCall(Protocol):
    """What a Prefill or Decode request says about its prompt and lent prefix."""

    prompt_token_ids: Sequence[int]
    peer_prefix: engine_pb2.PeerPrefix

    def HasField(self, name: str) -> bool: ...


async def peer_prefix_pull(service: EngineService, request: PrefixCall, params: SamplingParams,
                           context: grpc.aio.ServicerContext, span: Span
                           ) -> StartedPrefix | None:
    """Start the pull of the call's lent prefix, if it brings one and this instance can take
    it; a bad handle aborts the call (INVALID_ARGUMENT). None: computed whole (a transfer
    that cannot start is counted; the lender's lease then ends by itself)."""
    if not request.HasField("peer_prefix"):
        return None
    peer = service.kv_peer
    if peer is None:
        return None
    try:
        handle = peer.prefixes.check(request.peer_prefix, len(request.prompt_token_ids))
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if params.prompt_logprobs is not None:  # every prompt position is computed here
        peer.prefixes.metrics.prefix_fallback("prompt_logprobs")
        return None
    started = await peer.prefixes.begin(request.peer_prefix, handle, span)
    if started is None:
        return None
    return StartedPrefix(peer.prefixes, request.peer_prefix, *started)


class KVPeerServicer(engine_pb2_grpc.KVPeerServicer):
    """`LendPrefix` and `ReleasePrefix` over the process's KV sender."""

    def __init__(self, service: EngineService, sender: KVSender, metrics: EngineMetrics) -> None:
        self.service = service
        self.engine = service.engine
        self.sender = sender
        self.metrics = metrics
        self._lock = threading.Lock()
        self._loans: dict[str, str] = {}  # loan id -> transfer id

    def owns(self, loan_id: str) -> bool:
        with self._lock:
            return loan_id in self._loans

    def released(self, loan_id: str) -> None:
        """The sender ended the loan's lease (any thread): unpin its blocks."""
        with self._lock:
            self._loans.pop(loan_id, None)
        self.engine.release_kv_nowait(loan_id)

    async def LendPrefix(self, request: engine_pb2.LendPrefixRequest,
                         context: grpc.aio.ServicerContext) -> engine_pb2.LendPrefixResponse:
        lend_id = request.request_id
        if not lend_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must be set")
        if not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: must be set")
        if self.sender.core is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this instance's engine core lends no KV")
        response = engine_pb2.LendPrefixResponse(instance_id=self.service.instance_id)
        try:
            loan = await self.engine.lend_prefix(
                lend_id, list(request.prompt_token_ids), request.cache_salt or None,
                min_blocks=max(1, request.min_blocks), max_blocks=request.max_blocks)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if not loan.block_ids:
            return response
        info = self.engine.info
        num_blocks = len(loan.block_ids)
        layout = export_layout(info, num_blocks, num_blocks * info.block_size)
        try:
            handle = self.sender.publish_export(lend_id, layout, loan.block_ids,
                                                loan.block_checksums,
                                                parse_algo(loan.checksum_algo),
                                                lease_s=LOAN_LEASE_S)
        except (KVTransferError, KVHandleError) as exc:
            self.engine.release_kv_nowait(lend_id)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"lend_prefix: {exc}")
        with self._lock:  # (a lease this young cannot have ended: it lasts seconds)
            self._loans[lend_id] = handle.transfer_id
        self.metrics.prefix_lent(num_blocks)
        response.kv.CopyFrom(handle.to_proto())
        response.num_blocks = num_blocks
        return response

    async def ReleasePrefix(self, request: engine_pb2.ReleaseKVRequest,
                            context: grpc.aio.ServicerContext) -> engine_pb2.ReleaseKVResponse:
        with self._lock:
            transfer_id = self._loans.get(request.request_id)
        if transfer_id is None or (request.transfer_id and request.transfer_id != transfer_id):
            return engine_pb2.ReleaseKVResponse(released=False)
        try:
            state = self.sender.cancel(transfer_id, request.reason or "released by the router")
        except KVTransferError:
            return engine_pb2.ReleaseKVResponse(released=False)
        return engine_pb2.ReleaseKVResponse(released=state.name == "CANCELLED")


class KVPeerPart:
    """The process's KV sender and the KVPeer service (a `RolePart` of every role that lends:
    `lends_kv`); the prefill role publishes its exports on `sender` and hears their release
    through `on_release`."""

    service_name = engine_pb2.DESCRIPTOR.services_by_name["KVPeer"].full_name
    work_methods = (f"/{service_name}/LendPrefix",)  # refused while draining

    def __init__(self, service: EngineService, metrics: EngineMetrics) -> None:
        config = service.config
        lease_s = getattr(config, "lease_s", 30.0)
        backends = service.kv_backends
        self._listeners: list[ReleaseListener] = []
        self.sender = KVSender(
            KVSenderConfig(
                host=config.host,
                port=config.kv_port,
                advertise_host=config.public_host,
                backends=tuple(b for b in backends if b in SENDER_BACKENDS) or backends,
                lease_s=lease_s,
                max_lease_s=max(getattr(config, "max_lease_s", 300.0), lease_s),
            ),
            on_release=self._released,
            on_sent=lambda _rid, nbytes: service.counters.add_sent(nbytes),
            tls=config.tls,
            token=config.cluster_token,
            core=core_cache(service),
        )
        self.servicer = KVPeerServicer(service, self.sender, metrics)
        self.receiver = KVReceiver(KVReceiverConfig(backends=backends), tls=config.tls,
                                   token=config.cluster_token)
        self.prefixes = PeerPrefixPulls(service, self.receiver, metrics,
                                        getattr(config, "kv_fetch_timeout_s", 30.0))

    def on_release(self, listener: ReleaseListener) -> None:
        """`listener(request_id, reason)` for every lease that ends that is not a loan."""
        self._listeners.append(listener)

    def _released(self, request_id: str, reason: ReleaseReason) -> None:
        if self.servicer.owns(request_id):
            self.servicer.released(request_id)
            return
        for listener in self._listeners:
            listener(request_id, reason)

    @property
    def kv_address(self) -> str:
        return self.sender.address

    async def start(self, server: grpc.aio.Server) -> None:
        await self.sender.start()
        engine_pb2_grpc.add_KVPeerServicer_to_server(self.servicer, server)

    def pending(self) -> int:
        return self.sender.pinned_count()  # exports and loans a peer has yet to pull

    async def stop(self) -> None:
        await self.sender.stop()  # releases every lease; the listeners unpin the blocks
        await self.receiver.close()
