"""Offload tiers in the cluster index and in routing: KV events carry their medium, Redis keeps
which medium of which instance holds a block, the lookup splits each instance's run by the
fastest medium, and prefix-aware routing weighs a tier hit below a paged one."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from pdmesh.engine.block_hash import BlockHash, HashScheme, hash_token_blocks
from pdmesh.engine.kv_events import (
    MEDIUM_DISK,
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    Medium,
)
from pdmesh.kvstore.instance_registry import InstanceInfo, InstanceRegistry
from pdmesh.kvstore.prefix_index import PrefixHits, PrefixIndex, encode_events
from pdmesh.kvstore.redis_conn import RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace
from pdmesh.metrics import router_metrics
from pdmesh.router.instance import Instance
from pdmesh.router.pd_decider import PrefillDecider
from pdmesh.router.planner import Planner
from pdmesh.router.request import PreparedRequest
from pdmesh.router.routing.base import Candidate, LoadSnapshot, RouteRequest
from pdmesh.router.routing.factory import make_policy
from pdmesh.router.routing.prefix_aware import (
    DISK_HIT_WEIGHT,
    HOST_HIT_WEIGHT,
    PrefixAwarePolicy,
    prefix_cost,
)
from pdmesh.v1 import common_pb2, engine_pb2
from tests.redis_fixture import (  # noqa: F401  (fixtures register by import)
    anyio_backend_fixture,
    conn_fixture,
    keyspace_fixture,
    raw_fixture,
    redis_server_fixture,
)

SCHEME = HashScheme(block_size=4)
HASHES: list[BlockHash] = hash_token_blocks(SCHEME, list(range(4 * 16)))


def stored(*indices: int, medium: Medium = "paged") -> BlockStored:
    return BlockStored(tuple(HASHES[i] for i in indices), None, medium)


def removed(*indices: int, medium: Medium = "paged") -> BlockRemoved:
    return BlockRemoved(tuple(HASHES[i] for i in indices), medium)


class Instances:
    def __init__(self, conn: RedisConnection, keys: KeySpace) -> None:
        self.registry = InstanceRegistry(conn, keys, ttl_s=30.0)
        self.index = PrefixIndex(conn, keys)
        self._seq: dict[str, int] = {}
        self._port = 41000

    async def add(self) -> str:
        self._port += 1
        info = InstanceInfo.create(role="decode", address=f"127.0.0.1:{self._port}",
                                   model=self.index.keys.model, scheme=SCHEME)
        await self.registry.register(info)
        return info.instance_id

    async def publish(self, instance_id: str, *events: KVEvent) -> None:
        seq = self._seq.get(instance_id, -1) + 1
        self._seq[instance_id] = seq
        await self.index.apply(KVEventBatch(instance_id, seq, list(events)))


@pytest.fixture(name="instances")
async def instances_fixture(conn: RedisConnection, keyspace: KeySpace
                            ) -> AsyncIterator[Instances]:
    yield Instances(conn, keyspace)


@pytest.mark.fast
def test_events_encode_their_medium() -> None:
    args = encode_events([stored(0), stored(1, medium=MEDIUM_HOST), removed(2, medium="disk")])
    assert args == ["S", "1", HASHES[0].hex(), "Sh", "1", HASHES[1].hex(),
                    "Rd", "1", HASHES[2].hex()]


@pytest.mark.redis
@pytest.mark.anyio
async def test_the_index_keeps_each_blocks_medium_per_instance(
        instances: Instances, raw: aioredis.Redis) -> None:
    a, b = await instances.add(), await instances.add()
    # a: blocks 0-1 paged, 2-3 moved to its host tier, 4 on its disk tier, and a host copy of
    # block 0 (the tiers keep what they restored); b: blocks 0-5 paged.
    await instances.publish(a, stored(0, 1, 2, 3), removed(2, 3), stored(2, 3, 0, medium="host"),
                            stored(4, medium=MEDIUM_DISK))
    await instances.publish(b, stored(0, 1, 2, 3, 4, 5))
    hits = await instances.index.longest_prefix_by_medium(HASHES[:8])
    assert hits == {a: PrefixHits(paged=2, host=2, disk=1), b: PrefixHits(paged=6)}
    assert await instances.index.longest_prefix(HASHES[:8]) == {a: 5, b: 6}
    keys = instances.index.keys
    assert await raw.smembers(keys.block(HASHES[2], "host")) == {a}
    assert await raw.smembers(keys.block(HASHES[2])) == {b}
    # Block 0 leaves a's paged cache: its host copy still serves (the run is unbroken).
    await instances.publish(a, removed(0))
    assert (await instances.index.longest_prefix_by_medium(HASHES[:8]))[a] == PrefixHits(1, 3, 1)
    # A host-tier-only first block is found too.
    await instances.publish(b, AllBlocksCleared(), stored(0, 1, medium=MEDIUM_HOST))
    assert (await instances.index.longest_prefix_by_medium(HASHES[:8]))[b] == PrefixHits(0, 2)
    # Clearing drops every medium, and leaves no key behind.
    await instances.publish(a, AllBlocksCleared())
    assert a not in await instances.index.longest_prefix_by_medium(HASHES[:8])
    assert not await raw.exists(keys.held(a), keys.block(HASHES[4], "disk"))


@pytest.mark.redis
@pytest.mark.anyio
async def test_a_host_tier_hit_is_scored_below_a_paged_hit_elsewhere(
        instances: Instances) -> None:
    a, b = await instances.add(), await instances.add()
    await instances.publish(a, stored(0, 1, 2, 3, 4, 5, 6, 7, medium=MEDIUM_HOST))
    await instances.publish(b, stored(0, 1, 2, 3, 4, 5, 6, 7))
    hits = await instances.index.longest_prefix_by_medium(HASHES[:10])
    route = RouteRequest(num_prompt_tokens=40, block_size=4)
    load = LoadSnapshot(num_total_blocks=100, num_free_blocks=90)
    candidates = [Candidate(i, load, h.blocks, h.host, h.disk) for i, h in hits.items()]
    decision = PrefixAwarePolicy().pick(route, candidates)
    assert decision.instance_id == b
    costs = {c.instance_id: prefix_cost(route, c, 1.0) for c in candidates}
    assert costs[a] - costs[b] == pytest.approx(8 * (1 - HOST_HIT_WEIGHT))


@pytest.mark.fast
def test_tier_weights_order_paged_host_disk_and_a_longer_tier_run_can_win() -> None:
    assert 0 < DISK_HIT_WEIGHT < HOST_HIT_WEIGHT < 1
    route = RouteRequest(num_prompt_tokens=640, block_size=16)  # 40 blocks (README example)
    load = LoadSnapshot(num_total_blocks=100, num_free_blocks=70)
    d0 = Candidate("d0", load, cached_blocks=32)
    d1 = Candidate("d1", load, cached_blocks=40, host_blocks=20, disk_blocks=10)
    assert prefix_cost(route, d0, 1.0) == pytest.approx(38)
    assert prefix_cost(route, d1, 1.0) == pytest.approx(37)
    assert PrefixAwarePolicy().pick(route, [d0, d1]).instance_id == "d1"
    d1_short = Candidate("d1", load, cached_blocks=30, host_blocks=20)
    assert prefix_cost(route, d1_short, 1.0) == pytest.approx(42)
    assert PrefixAwarePolicy().pick(route, [d0, d1_short]).instance_id == "d0"


class StandInPool:
    """The pool as the planner reads it: live decode instances with the index's ids."""

    block_size = 4
    scheme = SCHEME
    index_detail = ""

    def __init__(self, ids: list[str]) -> None:
        self.instances = [
            Instance(address=f"127.0.0.1:{port}", role="decode", channel=None,  # type: ignore[arg-type]
                     info=engine_pb2.EngineInfo(instance_id=i), healthy=True)
            for port, i in enumerate(ids, 9100)]

    def routable(self, role: str) -> list[Instance]:
        return [i for i in self.instances if i.serves(role)]


@pytest.mark.redis
@pytest.mark.anyio
async def test_the_planner_weighs_each_candidates_hits_by_medium(instances: Instances) -> None:
    a, b = await instances.add(), await instances.add()
    await instances.publish(a, stored(*range(8), medium=MEDIUM_HOST))
    await instances.publish(b, stored(*range(8)))
    policies = {"decode": make_policy("prefix_aware"), "prefill": make_policy("prefix_aware")}
    planner = Planner(StandInPool([a, b]), policies, instances.index,  # type: ignore[arg-type]
                      PrefillDecider(1 << 30), router_metrics(CollectorRegistry()))

    def request(num_tokens: int) -> PreparedRequest:
        return PreparedRequest(request_id="r", prompt_token_ids=list(range(num_tokens)),
                               sampling=common_pb2.SamplingParams(), n=1, max_tokens=4,
                               cache_salt="", priority=0, stream=False, received_at=0.0,
                               deadline=1e18)

    plan = await planner.plan(request(40))  # 10 blocks: 8 paged on b, 8 in a's host tier
    assert plan.decode.instance_id == b
    assert plan.lookup.tiers == {a: PrefixHits(host=8), b: PrefixHits(paged=8)}
    assert plan.lookup.cached == {a: 8, b: 8}
    # a's host tier also holds blocks 8-9: 10 blocks at 0.9 beat 8 paged ones.
    await instances.publish(a, stored(8, 9, medium=MEDIUM_HOST))
    assert (await planner.plan(request(40))).decode.instance_id == a
