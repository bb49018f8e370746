"""The router checks its prefix-cache predictions (issue 25): what the index promised the
instance that computed a prompt against the cached tokens that instance reported; an instance
whose index slice keeps missing is asked, through Redis, to re-publish it, and does."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from pdmesh.engine.block_hash import HashScheme, hash_token_blocks
from pdmesh.engine_svc.presence import ClusterPresence
from pdmesh.kvstore.instance_registry import Heartbeat, InstanceInfo, InstanceRegistry
from pdmesh.kvstore.prefix_index import PrefixHits, PrefixIndex
from pdmesh.kvstore.redis_conn import RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace
from pdmesh.metrics import RouterMetrics, router_metrics
from pdmesh.router.instance import Instance
from pdmesh.router.pd_decider import PrefillDecider
from pdmesh.router.planner import Planner
from pdmesh.router.prefix_predictions import (
    DriftRule,
    Observation,
    PrefixPredictions,
    observe,
    predicted_tokens,
)
from pdmesh.router.request import Lookup, Plan, PreparedRequest
from pdmesh.router.routing.base import RouteRequest
from pdmesh.router.routing.factory import make_policy
from pdmesh.v1 import common_pb2, engine_pb2
from tests.redis_fixture import (  # noqa: F401  (fixtures register by import)
    anyio_backend_fixture,
    conn_fixture,
    keyspace_fixture,
    raw_fixture,
    redis_server_fixture,
    wait_until,
)
from tests.unit.test_cluster_presence import HeldBlocks

BLOCK = 16


def instance(instance_id: str, role: str = "decode") -> Instance:
    return Instance(address=f"127.0.0.1:{9000 + len(instance_id)}", role=role,
                    channel=None,  # type: ignore[arg-type]  (never called here)
                    info=engine_pb2.EngineInfo(instance_id=instance_id), healthy=True)


def request(num_tokens: int, *, prompt_logprobs: bool = False) -> PreparedRequest:
    sampling = common_pb2.SamplingParams()
    if prompt_logprobs:
        sampling.prompt_logprobs = 1
    return PreparedRequest(request_id="r", prompt_token_ids=list(range(num_tokens)),
                           sampling=sampling, n=1, max_tokens=4, cache_salt="", priority=0,
                           stream=False, received_at=0.0, deadline=1e18)


def plan(cached: dict[str, int], num_tokens: int, *, prefill: str | None = None,
         ok: bool = True) -> Plan:
    return Plan(instance("d"), instance(prefill, "prefill") if prefill else None, "test",
                RouteRequest(num_tokens, BLOCK),
                Lookup(cached if ok else {}, consulted=True, ok=ok))


def decode_result(instance_id: str, cached_tokens: int, fallback: str = ""
                  ) -> engine_pb2.DecodeResult:
    result = engine_pb2.DecodeResult(instance_id=instance_id, kv_load_fallback=fallback)
    result.usage.cached_prompt_tokens = cached_tokens
    return result


def metrics() -> RouterMetrics:
    return router_metrics(CollectorRegistry())


def sample(m: RouterMetrics, name: str, **labels: str) -> float:
    """A metric's current value by sample name (prometheus_client keeps a registry per test)."""
    for family in (m.prefix_predictions, m.prefix_prediction_error, m.prefix_republish_asks):
        for metric in family.collect():
            for s in metric.samples:
                if s.name == name and s.labels == labels:
                    return float(s.value)
    return 0.0


# -- the prediction and what is compared -----------------------------------------------------
@pytest.mark.fast
def test_the_prediction_is_capped_as_the_engine_caps_a_hit() -> None:
    # 80 tokens = 5 blocks, but the engine leaves the last token to compute: 4 blocks at most.
    assert predicted_tokens(plan({"d": 5}, 80), "d") == 4 * BLOCK
    assert predicted_tokens(plan({"d": 5}, 81), "d") == 5 * BLOCK
    assert predicted_tokens(plan({"d": 2}, 81), "d") == 2 * BLOCK
    assert predicted_tokens(plan({"d": 2}, 81), "other") == 0  # the index knew of none
    assert predicted_tokens(plan({"d": 3}, 1), "d") == 0


@pytest.mark.fast
def test_the_instance_that_computed_the_prompt_is_compared() -> None:
    # Local prefill: the decode instance's own report.
    obs = observe(request(81), plan({"d": 5}, 81), None, decode_result("d", 3 * BLOCK),
                  moved=False)
    assert obs == Observation("d", 5 * BLOCK, 3 * BLOCK, BLOCK)
    assert (obs.error_tokens, obs.outcome) == (2 * BLOCK, "over")
    # Remote prefill: the prefill instance's report, whatever the decode instance says.
    prefill = engine_pb2.PrefillResponse(instance_id="p", cached_prompt_tokens=4 * BLOCK)
    obs = observe(request(81), plan({"d": 5, "p": 1}, 81, prefill="p"), prefill,
                  decode_result("d", 0, fallback="pull failed"), moved=False)
    assert obs == Observation("p", BLOCK, 4 * BLOCK, BLOCK)
    assert obs.outcome == "under"
    exact = observe(request(81), plan({"d": 2}, 81), None, decode_result("d", 2 * BLOCK),
                    moved=False)
    assert exact is not None and exact.outcome == "exact"


@pytest.mark.fast
def test_requests_without_a_fair_comparison_are_left_out() -> None:
    plain, report = request(81), decode_result("d", 0)

    def check(req: PreparedRequest = plain, p: Plan | None = None,
              prefill: engine_pb2.PrefillResponse | None = None,
              result: engine_pb2.DecodeResult | None = report,
              moved: bool = False) -> Observation | None:
        return observe(req, p or plan({"d": 5}, 81), prefill, result, moved=moved)

    assert check() is not None  # the baseline is compared
    assert check(moved=True) is None  # re-routed, migrated
    assert check(p=plan({"d": 5}, 81, ok=False)) is None  # the index did not answer
    unconsulted = Plan(instance("d"), None, "t", RouteRequest(81, BLOCK),
                       Lookup({}, consulted=False, ok=False))
    assert check(p=unconsulted) is None  # routing did not ask the index
    assert check(req=request(81, prompt_logprobs=True)) is None  # the engine skips its cache
    assert check(result=None) is None  # no result came back
    assert check(result=decode_result("d", 0, fallback="recomputed")) is None
    assert check(result=decode_result("someone-else", 0)) is None
    # A planned remote prefill whose response never came: nothing to compare.
    assert check(p=plan({"d": 5}, 81, prefill="p"), prefill=None) is None


# -- the record and the drift rule -----------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def miss(instance_id: str = "a", blocks: int = -3) -> Observation:
    """An observation off by `blocks` (negative: under-predicted)."""
    return Observation(instance_id, max(0, blocks) * BLOCK, max(0, -blocks) * BLOCK, BLOCK)


@pytest.mark.fast
def test_the_record_counts_outcomes_and_the_signed_error() -> None:
    m = metrics()
    predictions = PrefixPredictions(m, None, DriftRule(misses=4, window=4))
    for obs in (miss(blocks=2), miss(blocks=-3), miss(blocks=0), miss(blocks=1)):
        assert not predictions.record(obs)
    record = predictions.records["a"]
    assert (record.checked, record.exact, record.over, record.under) == (4, 1, 2, 1)
    assert record.error_sum_tokens == 0  # +2 -3 +0 +1 blocks
    assert record.misses(2 * BLOCK) == 2  # |error| >= 2 blocks: the +2 and the -3
    assert sample(m, "pdmesh:router_prefix_predictions_total",
                  instance="a", outcome="over") == 2
    assert sample(m, "pdmesh:router_prefix_prediction_error_tokens_count", instance="a") == 4
    assert sample(m, "pdmesh:router_prefix_prediction_error_tokens_sum",
                  instance="a") == 6 * BLOCK
    assert sample(m, "pdmesh:router_prefix_prediction_error_tokens_bucket",
                  instance="a", le="0.0") == 1


@pytest.mark.fast
def test_an_ask_comes_only_past_the_bound_then_the_record_restarts_and_asks_wait() -> None:
    clock = Clock()
    rule = DriftRule(min_blocks=2, misses=3, window=5, ask_interval_s=60.0)
    predictions = PrefixPredictions(metrics(), None, rule, clock=clock)
    # Misses of one block, and misses scattered thinner than 3 in 5, never ask.
    assert not any(predictions.record(miss(blocks=-1)) for _ in range(20))
    for blocks in (-2, 0, 0, 4, 0, 0, -3, 0, 0):
        assert not predictions.record(miss(blocks=blocks))
    # Another instance's misses are its own.
    assert not predictions.record(miss("b", -5))
    # The third miss within the window of five: drift, one ask.
    assert not predictions.record(miss(blocks=-2))
    assert predictions.record(miss(blocks=5))
    record = predictions.records["a"]
    assert (record.checked, list(record.recent), record.asked_at) == (0, [], 1000.0)
    # Drift again before the interval: counted, not asked.
    clock.now += 59.0
    assert not any(predictions.record(miss(blocks=-4)) for _ in range(5))
    assert predictions.records["a"].checked == 5
    # Once the interval has passed, the next miss past the bound asks again.
    clock.now += 1.0
    assert predictions.record(miss(blocks=-4))
    assert not predictions.records["b"].asked_at


@pytest.mark.fast
def test_records_are_bounded_and_a_forgotten_instance_leaves_no_series() -> None:
    m = metrics()
    predictions = PrefixPredictions(m, None)
    predictions.MAX_INSTANCES = 3
    for name in ("a", "b", "c", "a", "d"):
        predictions.record(miss(name, 0))
    assert list(predictions.records) == ["c", "a", "d"]  # b was the least recently checked
    assert sample(m, "pdmesh:router_prefix_predictions_total",
                  instance="b", outcome="exact") == 0
    assert sample(m, "pdmesh:router_prefix_predictions_total",
                  instance="a", outcome="exact") == 2


@pytest.mark.fast
def test_a_rule_that_can_never_fire_is_refused() -> None:
    with pytest.raises(ValueError):
        DriftRule(misses=5, window=4)
    with pytest.raises(ValueError):
        DriftRule(min_blocks=0)


# -- the loop through Redis ------------------------------------------------------------------
SCHEME = HashScheme(block_size=BLOCK)


class OnePool:
    """What the planner reads of an instance pool: one routable decode instance."""

    scheme = SCHEME
    block_size = BLOCK
    index_detail = ""

    def __init__(self, decode: Instance) -> None:
        self.decode = decode

    def routable(self, role: str) -> list[Instance]:
        return [self.decode] if self.decode.serves(role) else []


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_drifted_instance_is_asked_and_its_index_recovers(
        conn: RedisConnection, keyspace: KeySpace, raw: aioredis.Redis) -> None:
    prompt = list(range(8 * BLOCK + 1))
    hashes = hash_token_blocks(SCHEME, prompt)  # 8 whole blocks
    held = HeldBlocks(hashes)
    info = InstanceInfo.create(role="decode", address="127.0.0.1:7", model=keyspace.model,
                               scheme=SCHEME)
    presence = ClusterPresence(conn, info, load=held.load, take_events=held.take_events,
                               snapshot=held.snapshot, events_ready=held.events_ready,
                               ttl_s=0.6)  # heartbeats every 0.2 s
    index = PrefixIndex(conn, keyspace)
    m = metrics()
    policies = {"decode": make_policy("prefix_aware"), "prefill": make_policy("prefix_aware")}
    planner = Planner(OnePool(instance(info.instance_id)), policies,  # type: ignore[arg-type]
                      index, PrefillDecider(1 << 30), m,
                      DriftRule(min_blocks=2, misses=2, window=3, ask_ttl_s=30.0))
    req = request(len(prompt))
    engine_report = decode_result(info.instance_id, 8 * BLOCK)  # the engine's cache: 8 blocks

    async def indexed() -> int:
        return (await index.longest_prefix(hashes)).get(info.instance_id, 0)

    async def fully_indexed() -> bool:
        return await indexed() == len(hashes)

    async def ask_answered() -> bool:
        return not await raw.exists(keyspace.republish(info.instance_id))

    assert await presence.try_register()
    presence.start()
    try:
        await wait_until(fully_indexed)
        exact = planner.predictions.check(req, await planner.plan(req), None, engine_report,
                                          moved=False)
        assert exact is not None and exact.outcome == "exact"

        # The index loses the instance's blocks (a drifted slice): the engine still holds them.
        for h in hashes:
            await raw.srem(keyspace.block(h), info.instance_id)
        await raw.delete(keyspace.held(info.instance_id))
        assert await indexed() == 0
        first = await planner.plan(req)
        assert first.lookup.tiers.get(info.instance_id, PrefixHits()) == PrefixHits()
        under = planner.predictions.check(req, first, None, engine_report, moved=False)
        assert under is not None and under.error_tokens == -8 * BLOCK
        assert not await raw.exists(keyspace.republish(info.instance_id))  # one miss: no ask
        planner.predictions.check(req, await planner.plan(req), None, engine_report,
                                  moved=False)
        await planner.predictions.drain()
        assert sample(m, "pdmesh:router_prefix_republish_asks_total",
                      instance=info.instance_id, outcome="sent") == 1

        # The presence loop's heartbeat finds the ask and re-publishes: the index recovers,
        # and the applied snapshot clears the ask.
        await wait_until(fully_indexed)
        assert presence.republish_asks == 1
        await wait_until(ask_answered)
        again = planner.predictions.check(req, await planner.plan(req), None, engine_report,
                                          moved=False)
        assert again is not None and again.outcome == "exact"
        assert sample(m, "pdmesh:router_prefix_predictions_total",
                      instance=info.instance_id, outcome="under") == 2
    finally:
        await presence.stop()


@pytest.mark.redis
@pytest.mark.anyio
async def test_an_ask_waits_in_redis_and_registration_or_snapshot_clears_it(
        conn: RedisConnection, keyspace: KeySpace, raw: aioredis.Redis) -> None:
    registry, index = InstanceRegistry(conn, keyspace), PrefixIndex(conn, keyspace)
    info = InstanceInfo.create(role="decode", address="127.0.0.1:8", model=keyspace.model,
                               scheme=SCHEME)
    await registry.register(info)
    assert await registry.heartbeat(info.instance_id) is Heartbeat.ALIVE
    assert await index.ask_republish(info.instance_id, ttl_s=30.0)
    assert not await index.ask_republish(info.instance_id, ttl_s=30.0)  # one is waiting
    assert 0 < await raw.pttl(keyspace.republish(info.instance_id)) <= 30_000
    assert await registry.heartbeat(info.instance_id) is Heartbeat.REPUBLISH
    assert await registry.heartbeat(info.instance_id) is Heartbeat.REPUBLISH  # until answered
    await registry.register(info)  # a registration starts clean: a snapshot follows anyway
    assert await registry.heartbeat(info.instance_id) is Heartbeat.ALIVE
    await index.ask_republish(info.instance_id, ttl_s=30.0)
    await registry.deregister(info.instance_id)
    assert not await raw.exists(keyspace.republish(info.instance_id))
    assert not await registry.heartbeat(info.instance_id)  # GONE is falsy, as before
