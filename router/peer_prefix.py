"""Cluster-wide prefix caching, the router's half: when another live instance holds more of a
prompt's leading blocks than the instance about to compute it, should that instance pull them
instead of computing them, and if so, arrange the loan.

The cost model (router/routing/README.md, "Peer reuse", with a worked example) compares two
measured times for the blocks the lender holds beyond the target's own hit:

    saved_s = extra_tokens / prefill_tokens_per_s(target)
    cost_s  = control_s + lender_wait_s(lender)
              + max(0, extra_blocks × block_bytes / bytes_per_s(pair) − queue_s(target))

- `prefill_tokens_per_s`: the target's step-cost model rate (`EngineLoad.model_prefill_tokens_
  per_s`), before it has fitted its mean rate over the steps it ran, before its first step a
  high default (a fast GPU), so an unknown target pulls only when the move is cheap even
  against that;
- `bytes_per_s(pair)`: measured per (lender, target) pair from the pulls the targets report
  (`PeerPrefixResult`: bytes over pull time, an EWMA), before the first one a default by
  whether the pair shares a host (shm) or not (tcp);
- `lender_wait_s`: the lender's core answers between two steps, half its mean step on average;
- `queue_s(target)`: the target's core pulls while the request waits in its queue, so the
  requests waiting there (each at least one of its mean steps) hide the move;
- `control_s`: the LendPrefix and StartTransfer round trips (measured, an EWMA).

A pull happens when `saved_s > cost_s` and at least `--kv-peer-reuse-min-tokens` are saved.
The lender pins the blocks under a lease (engine_svc/kv_peer.py); every failure on the way (the
lender holds less than the index said, its call fails, the pull fails a checksum) falls back to
computing the prompt, and never changes a token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from pdmesh.auth import ClusterToken
from pdmesh.kvstore.transfer.capability import TransferCapability
from pdmesh.metrics import RouterMetrics
from pdmesh.router.instance import Instance
from pdmesh.router.request import Lookup, PreparedRequest
from pdmesh.tracing import inject_metadata
from pdmesh.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_TOKENS_PER_S = 20_000.0
"""A target whose step-cost model has not fitted yet is assumed this fast (an H100 prefills an
8B model at about this rate): only a cheap move is worth it against it."""
SAME_HOST_BYTES_PER_S = 1.0e9
"""Until a pair's first pull is measured, on one host (shm: one copy, bench/transfer.py
measures several GB/s on the 2-core CI host; conservative)."""
CROSS_HOST_BYTES_PER_S = 0.5e9
"""... and across hosts (tcp)."""
DEFAULT_CONTROL_S = 0.005
"""LendPrefix + StartTransfer round trips before any was measured."""
EWMA_WEIGHT = 0.3
LEND_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class PullCost:
    """The two sides of the decision, in seconds (module docstring)."""

    extra_tokens: int
    nbytes: int
    prefill_tokens_per_s: float
    bytes_per_s: float
    control_s: float
    lender_wait_s: float
    queue_s: float = 0.0  # the target's queue ahead of the request: the move hides in it

    @property
    def saved_s(self) -> float:
        return self.extra_tokens / self.prefill_tokens_per_s

    @property
    def cost_s(self) -> float:
        transfer_s = self.nbytes / self.bytes_per_s
        return self.control_s + self.lender_wait_s + max(0.0, transfer_s - self.queue_s)

    @property
    def worth_it(self) -> bool:
        return self.saved_s > self.cost_s


@dataclass(frozen=True)
class PrefixOffer:
    """A lender that holds more of the prompt than the target, and what pulling would cost."""

    lender: Instance
    lender_blocks: int  # leading prompt blocks it holds (usable: the engine's cap applied)
    target_blocks: int
    cost: PullCost


def usable_blocks(num_prompt_tokens: int, block_size: int, cached_blocks: int) -> int:
    """Leading blocks an engine can take as a hit: at least one prompt token is computed."""
    return min(cached_blocks, (num_prompt_tokens - 1) // block_size)


def host_of(address: str) -> str:
    """The host part of `host:port` (or `[v6]:port`)."""
    return address.rsplit(":", 1)[0].strip("[]")


def mean_step_s(load: engine_pb2.EngineLoad) -> float:
    return load.step_seconds / load.num_steps if load.num_steps else 0.0


def prefill_rate(load: engine_pb2.EngineLoad) -> float:
    """Prompt tokens per second the instance computes: its step-cost model's rate, else its
    mean over every step so far (decode steps make it low: pulling is then favoured, rightly
    on the hardware that is slow), else the fast default."""
    if load.model_prefill_tokens_per_s > 0:
        return float(load.model_prefill_tokens_per_s)
    if load.step_seconds > 0 and load.scheduled_tokens:
        return load.scheduled_tokens / load.step_seconds
    return DEFAULT_PREFILL_TOKENS_PER_S


@dataclass
class PairRates:
    """Measured transfer bandwidth per (lender, target) pair, and the control round trip."""

    bytes_per_s: dict[tuple[str, str], float] = field(default_factory=dict)
    control_s: float = DEFAULT_CONTROL_S

    def bandwidth(self, lender: Instance, target: Instance) -> float:
        measured = self.bytes_per_s.get((lender.instance_id, target.instance_id))
        if measured is not None:
            return measured
        same = host_of(lender.address) == host_of(target.address)
        return SAME_HOST_BYTES_PER_S if same else CROSS_HOST_BYTES_PER_S

    def observe_pull(self, lender_id: str, target_id: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        key = (lender_id, target_id)
        old = self.bytes_per_s.get(key)
        self.bytes_per_s[key] = rate if old is None else old + EWMA_WEIGHT * (rate - old)

    def observe_control(self, seconds: float) -> None:
        self.control_s += EWMA_WEIGHT * (2 * seconds - self.control_s)  # lend + start


def pull_cost(extra_blocks: int, block_size: int, target: Instance, lender: Instance,
              rates: PairRates) -> PullCost:
    block_bytes = target.info.kv_block_bytes if target.info is not None else 0
    return PullCost(
        extra_tokens=extra_blocks * block_size,
        nbytes=extra_blocks * block_bytes,
        prefill_tokens_per_s=prefill_rate(target.load),
        bytes_per_s=rates.bandwidth(lender, target),
        control_s=rates.control_s,
        lender_wait_s=mean_step_s(lender.load) / 2,
        queue_s=target.load.num_waiting * mean_step_s(target.load),
    )


def best_offer(num_prompt_tokens: int, block_size: int, target: Instance, lookup: Lookup,
               live: Iterable[Instance], rates: PairRates, min_tokens: int
               ) -> PrefixOffer | None:
    """The live instance holding the most of the prompt beyond the target's own hit, with
    the cost of pulling its extra blocks; None when no instance holds `min_tokens` more."""
    target_blocks = usable_blocks(num_prompt_tokens, block_size,
                                  lookup.cached.get(target.instance_id, 0))
    best: tuple[int, Instance] | None = None
    for instance in live:
        if not instance.instance_id or instance.instance_id == target.instance_id:
            continue
        held = usable_blocks(num_prompt_tokens, block_size,
                             lookup.cached.get(instance.instance_id, 0))
        if best is None or held > best[0] or (held == best[0] and mean_step_s(
                instance.load) < mean_step_s(best[1].load)):
            best = (held, instance)
    if best is None or (best[0] - target_blocks) * block_size < max(1, min_tokens):
        return None
    held, lender = best
    return PrefixOffer(lender, held, target_blocks,
                       pull_cost(held - target_blocks, block_size, target, lender, rates))


@dataclass(frozen=True)
class PeerReuse:
    """The router's peer-reuse settings (RouterConfig's `--kv-peer-reuse*`)."""

    enabled: bool = True
    min_tokens: int = 32


class PeerPrefixes:
    """Offers and loans for one router: `offer` a request's target a lent prefix (None:
    compute it all), `observe` how the pull went."""

    def __init__(self, settings: PeerReuse, metrics: RouterMetrics,
                 token: ClusterToken | None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.token = token
        self.rates = PairRates()
        self._serial = 0

    async def offer(self, req: PreparedRequest, lookup: Lookup, target: Instance,
                    live: Iterable[Instance], block_size: int) -> Loan | None:
        """The lent prefix `target` should pull for `req`, its loan made; None when no peer
        holds enough more, the cost model declines, or the loan fails (computed whole)."""
        if not self.settings.enabled or not lookup.ok or req.sampling.HasField(
                "prompt_logprobs"):
            return None
        offer = best_offer(len(req.prompt_token_ids), block_size, target, lookup, live,
                           self.rates, self.settings.min_tokens)
        if offer is None:
            return None
        span = trace.get_current_span()
        if span.is_recording():
            span.add_event("pdmesh.peer_prefix.offer", {
                "pdmesh.peer_prefix.lender": offer.lender.instance_id,
                "pdmesh.peer_prefix.target": target.instance_id,
                "pdmesh.peer_prefix.lender_blocks": offer.lender_blocks,
                "pdmesh.peer_prefix.target_blocks": offer.target_blocks,
                "pdmesh.peer_prefix.saved_s": offer.cost.saved_s,
                "pdmesh.peer_prefix.cost_s": offer.cost.cost_s})
        if not offer.cost.worth_it:
            self.metrics.peer_prefix_offers.labels("declined").inc()
            logger.debug("peer prefix declined request_id=%s saved_s=%.4f cost_s=%.4f",
                         req.request_id, offer.cost.saved_s, offer.cost.cost_s)
            return None
        return await self._lend(req, offer, target)

    async def _lend(self, req: PreparedRequest, offer: PrefixOffer, target: Instance
                    ) -> Loan | None:
        self._serial += 1
        loan_id = f"{req.request_id}/prefix/{self._serial}"
        lender = offer.lender
        started = time.monotonic()
        try:
            reply = await engine_pb2_grpc.KVPeerStub(lender.channel).LendPrefix(
                engine_pb2.LendPrefixRequest(
                    request_id=loan_id, prompt_token_ids=req.prompt_token_ids,
                    cache_salt=req.cache_salt, min_blocks=offer.target_blocks + 1,
                    max_blocks=offer.lender_blocks),
                timeout=min(LEND_TIMEOUT_S, max(0.05, req.deadline - started)),
                metadata=inject_metadata())
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            self.metrics.peer_prefix_offers.labels("lend_failed").inc()
            logger.info("LendPrefix on %s failed: %s", lender.address,
                        exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else exc)
            return None
        self.rates.observe_control(time.monotonic() - started)
        if not reply.HasField("kv"):  # it holds less than the index said (evicted since)
            self.metrics.peer_prefix_offers.labels("lender_empty").inc()
            return None
        peer = engine_pb2.PeerPrefix(kv=reply.kv, instance_id=lender.instance_id)
        if self.token is not None:  # the lender serves the loan to the target alone
            peer.capability.CopyFrom(TransferCapability.mint(
                self.token, reply.kv.transfer_id, target.instance_id).to_proto())
        return Loan(lender, target, loan_id, peer, reply.num_blocks)

    def observe(self, loan: Loan, result: engine_pb2.PeerPrefixResult | None) -> None:
        """How the target's pull went (its response's `peer_prefix`)."""
        if result is None:
            self.metrics.peer_prefix_offers.labels("fallback").inc()
            return
        if result.fallback:
            self.metrics.peer_prefix_offers.labels("fallback").inc()
            return
        if not result.blocks_pulled:  # the target held them already (its index entries lag)
            self.metrics.peer_prefix_offers.labels("reused").inc()
            return
        self.metrics.peer_prefix_offers.labels("pulled").inc()
        block_size = loan.target.info.block_size if loan.target.info is not None else 0
        self.metrics.peer_prefix_tokens.inc(result.blocks_pulled * block_size)
        self.rates.observe_pull(loan.lender.instance_id, loan.target.instance_id,
                                result.bytes, result.pull_ms / 1e3)


@dataclass(frozen=True)
class Loan:
    """A prefix lent for one call: who lends it, to whom, and what the call carries."""

    lender: Instance
    target: Instance
    loan_id: str
    peer: engine_pb2.PeerPrefix
    num_blocks: int
