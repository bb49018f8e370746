"""The router's peer-reuse decision (router/peer_prefix.py): which live instance lends, and
whether pulling its extra blocks beats computing them, from measured quantities (the worked
example of router/routing/README.md is checked here)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from pdmesh.metrics import RouterMetrics, router_metrics
from pdmesh.router.instance import Instance
from pdmesh.router.peer_prefix import (
    CROSS_HOST_BYTES_PER_S,
    DEFAULT_PREFILL_TOKENS_PER_S,
    SAME_HOST_BYTES_PER_S,
    Loan,
    PairRates,
    PeerPrefixes,
    PeerReuse,
    PullCost,
    best_offer,
    host_of,
    prefill_rate,
)
from pdmesh.router.request import Lookup, PreparedRequest
from pdmesh.v1 import common_pb2, engine_pb2

pytestmark = pytest.mark.fast

BLOCK = 16
MiB = 1 << 20


def instance(instance_id: str, host: str = "10.0.0.1", *, rate: float = 0.0,
             step_s: float = 0.0, block_bytes: int = 2 * MiB) -> Instance:
    inst = Instance(address=f"{host}:{9000 + len(instance_id)}", role="decode",
                    channel=None)  # type: ignore[arg-type]
    inst.info = engine_pb2.EngineInfo(instance_id=instance_id, block_size=BLOCK,
                                      kv_block_bytes=block_bytes)
    inst.load = engine_pb2.EngineLoad(model_prefill_tokens_per_s=rate,
                                      num_steps=100 if step_s else 0,
                                      step_seconds=100 * step_s)
    return inst


def lookup(**cached: int) -> Lookup:
    return Lookup(dict(cached), consulted=True, ok=True)


def test_worked_example_of_the_readme() -> None:
    """README: a 2,000-token turn, the target (a prefill instance) holds 40 blocks, the
    decode instance that wrote the previous turn holds 110; 70 blocks of 2 MiB each over a
    measured 4 GB/s, target prefills 8,000 tokens/s, the lender steps every 30 ms."""
    target = instance("prefill-0", rate=8000.0)
    lender = instance("decode-0", step_s=0.030)
    rates = PairRates()
    rates.observe_pull("decode-0", "prefill-0", 4_000_000_000, 1.0)
    rates.control_s = 0.004
    offer = best_offer(2000, BLOCK, target, lookup(**{"prefill-0": 40, "decode-0": 110}),
                       [target, lender], rates, min_tokens=32)
    assert offer is not None and offer.lender is lender
    cost = offer.cost
    assert cost.extra_tokens == 70 * BLOCK
    assert cost.saved_s == pytest.approx(0.140)
    assert cost.cost_s == pytest.approx(0.004 + 0.015 + 70 * 2 * MiB / 4e9)
    assert cost.worth_it
    # The same move against a target four times faster is not worth it...
    fast = instance("prefill-0", rate=32000.0)
    slow = best_offer(2000, BLOCK, fast, lookup(**{"prefill-0": 40, "decode-0": 110}),
                      [fast, lender], rates, min_tokens=32)
    assert slow is not None and not slow.cost.worth_it
    # ... unless two requests wait ahead of it at 30 ms steps: its queue hides the move.
    busy = instance("prefill-0", rate=32000.0, step_s=0.030)
    busy.load.num_waiting = 2
    hidden = best_offer(2000, BLOCK, busy, lookup(**{"prefill-0": 40, "decode-0": 110}),
                        [busy, lender], rates, min_tokens=32)
    assert hidden is not None and hidden.cost.cost_s == pytest.approx(0.019)
    assert hidden.cost.worth_it


def test_the_instance_holding_the_most_lends_and_the_target_never_lends_to_itself() -> None:
    target, a, b = instance("t"), instance("a"), instance("b")
    offer = best_offer(640, BLOCK, target, lookup(t=10, a=30, b=25), [target, a, b],
                       PairRates(), min_tokens=32)
    assert offer is not None and offer.lender is a
    assert (offer.lender_blocks, offer.target_blocks) == (30, 10)
    # The target itself holding the most: nobody lends.
    assert best_offer(640, BLOCK, target, lookup(t=30, a=30), [target, a], PairRates(),
                      min_tokens=32) is None


def test_a_hit_is_capped_as_the_engine_caps_it_and_small_gains_are_not_offered() -> None:
    target, a = instance("t"), instance("a")
    # A 100-token prompt: an engine takes at most (100 - 1) // 16 = 6 blocks as a hit.
    offer = best_offer(100, BLOCK, target, lookup(t=0, a=40), [target, a], PairRates(),
                       min_tokens=32)
    assert offer is not None and offer.lender_blocks == 6
    # 1 block (16 tokens) more than the target holds is below the minimum.
    assert best_offer(640, BLOCK, target, lookup(t=10, a=11), [target, a], PairRates(),
                      min_tokens=32) is None


def test_equal_holders_the_one_stepping_faster_lends() -> None:
    target, busy, idle = instance("t"), instance("busy", step_s=0.2), instance("idle",
                                                                                step_s=0.01)
    offer = best_offer(640, BLOCK, target, lookup(busy=20, idle=20), [target, busy, idle],
                       PairRates(), min_tokens=32)
    assert offer is not None and offer.lender is idle


def test_pair_bandwidth_defaults_by_host_then_follows_measured_pulls() -> None:
    target = instance("t", host="10.0.0.1")
    near, far = instance("n", host="10.0.0.1"), instance("f", host="10.0.0.2")
    rates = PairRates()
    assert rates.bandwidth(near, target) == SAME_HOST_BYTES_PER_S
    assert rates.bandwidth(far, target) == CROSS_HOST_BYTES_PER_S
    rates.observe_pull("f", "t", 2_000_000, 0.001)  # 2 GB/s measured
    assert rates.bandwidth(far, target) == pytest.approx(2e9)
    rates.observe_pull("f", "t", 1_000_000, 0.001)  # 1 GB/s: the average moves toward it
    assert 1e9 < rates.bandwidth(far, target) < 2e9
    rates.observe_pull("f", "t", 0, 0.0)  # nothing measured: nothing changes
    assert host_of("[::1]:9000") == "::1"


def test_prefill_rate_prefers_the_model_then_the_measured_mean_then_the_default() -> None:
    assert prefill_rate(engine_pb2.EngineLoad(model_prefill_tokens_per_s=900.0)) == 900.0
    assert prefill_rate(engine_pb2.EngineLoad(step_seconds=2.0, scheduled_tokens=1000)) == 500.0
    assert prefill_rate(engine_pb2.EngineLoad()) == DEFAULT_PREFILL_TOKENS_PER_S


def test_pull_cost_arithmetic() -> None:
    cost = PullCost(extra_tokens=320, nbytes=40 * MiB, prefill_tokens_per_s=1000.0,
                    bytes_per_s=1e9, control_s=0.005, lender_wait_s=0.02)
    assert cost.saved_s == pytest.approx(0.32)
    assert cost.cost_s == pytest.approx(0.025 + 40 * MiB / 1e9)
    assert cost.worth_it


def prepared(num_tokens: int, **sampling: object) -> PreparedRequest:
    return PreparedRequest(
        request_id="r", prompt_token_ids=list(range(num_tokens)),
        sampling=common_pb2.SamplingParams(**sampling), n=1, max_tokens=8, cache_salt="",
        priority=0, stream=False, received_at=0.0, deadline=1e12)


def counts(metrics: RouterMetrics) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for m in metrics.peer_prefix_offers.collect()
            for s in m.samples if s.name.endswith("_total")}


def test_offers_are_made_only_where_they_can_help_and_outcomes_are_counted() -> None:
    metrics = router_metrics(CollectorRegistry())
    peers = PeerPrefixes(PeerReuse(), metrics, token=None)
    fast_target = instance("t", rate=1e9)  # computing anything is instant: never worth a move
    lender = instance("a")
    found = lookup(t=0, a=30)
    live = [fast_target, lender]
    # Each of these returns before any call to the lender (its channel is None here).
    assert asyncio.run(peers.offer(prepared(640), found, fast_target, live, BLOCK)) is None
    assert counts(metrics) == {"declined": 1.0}
    assert asyncio.run(peers.offer(prepared(640, prompt_logprobs=1), found, fast_target, live,
                                   BLOCK)) is None
    assert asyncio.run(peers.offer(prepared(640), Lookup({}, consulted=True, ok=False),
                                   fast_target, live, BLOCK)) is None
    off = PeerPrefixes(PeerReuse(enabled=False), metrics, token=None)
    assert asyncio.run(off.offer(prepared(640), found, fast_target, live, BLOCK)) is None
    assert counts(metrics) == {"declined": 1.0}

    loan = Loan(lender, fast_target, "r/prefix/1", engine_pb2.PeerPrefix(), 30)
    peers.observe(loan, engine_pb2.PeerPrefixResult(blocks_pulled=30, bytes=60 * MiB,
                                                    pull_ms=30.0))
    peers.observe(loan, engine_pb2.PeerPrefixResult(blocks_reused=30))
    peers.observe(loan, engine_pb2.PeerPrefixResult(fallback="checksum"))
    peers.observe(loan, None)
    assert counts(metrics) == {"declined": 1.0, "pulled": 1.0, "reused": 1.0, "fallback": 2.0}
    assert peers.rates.bandwidth(lender, fast_target) == pytest.approx(60 * MiB / 0.030)
