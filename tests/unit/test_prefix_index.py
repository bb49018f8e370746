"""The cluster prefix index against a real redis-server."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from pdmesh.engine.block_hash import BlockHash, HashScheme, hash_token_blocks
from pdmesh.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from pdmesh.kvstore.instance_registry import InstanceInfo, InstanceRegistry
from pdmesh.kvstore.prefix_index import (
    ApplyStatus,
    PrefixHits,
    PrefixIndex,
    decode_prefix_reply,
    encode_events,
)
from pdmesh.kvstore.redis_conn import IndexUnavailable, RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace
from pdmesh.kvstore.redis_server import RedisServer
from tests.redis_fixture import (  # noqa: F401  (fixtures register by import)
    anyio_backend_fixture,
    conn_fixture,
    keyspace_fixture,
    raw_fixture,
    redis_server_fixture,
    wait_until,
)

pytestmark = pytest.mark.anyio

SCHEME = HashScheme(block_size=4)
HASHES: list[BlockHash] = hash_token_blocks(SCHEME, list(range(4 * 64)))  # 64 chained blocks


def stored(*indices: int) -> BlockStored:
    return BlockStored(tuple(HASHES[i] for i in indices))


def removed(*indices: int) -> BlockRemoved:
    return BlockRemoved(tuple(HASHES[i] for i in indices))


class Cluster:
    """Registered instances of one model and a per-instance event sequence counter."""

    def __init__(self, conn: RedisConnection, keys: KeySpace, ttl_s: float = 30.0) -> None:
        self.registry = InstanceRegistry(conn, keys, ttl_s=ttl_s)
        self.index = PrefixIndex(conn, keys)
        self._seq: dict[str, int] = {}
        self._port = 40000

    async def add(self, registry: InstanceRegistry | None = None) -> str:
        self._port += 1
        info = InstanceInfo.create(
            role="decode",
            address=f"127.0.0.1:{self._port}",
            model=self.index.keys.model,
            scheme=SCHEME,
        )
        await (registry or self.registry).register(info)
        return info.instance_id

    async def publish(self, instance_id: str, *events: KVEvent) -> ApplyStatus:
        seq = self._seq.get(instance_id, -1) + 1
        self._seq[instance_id] = seq
        result = await self.index.apply(KVEventBatch(instance_id, seq, list(events)))
        return result.status


@pytest.fixture
async def cluster(conn: RedisConnection, keyspace: KeySpace) -> AsyncIterator[Cluster]:
    yield Cluster(conn, keyspace)


@pytest.mark.fast
def test_encode_events_flattens_ops_and_hex_hashes() -> None:
    args = encode_events([stored(0, 1), AllBlocksCleared(), removed(2)])
    assert args == ["S", "2", HASHES[0].hex(), HASHES[1].hex(), "C", "R", "1", HASHES[2].hex()]
    with pytest.raises(TypeError):
        encode_events([object()])  # type: ignore[list-item]


@pytest.mark.fast
def test_decode_prefix_reply_pairs() -> None:
    assert decode_prefix_reply(["a", 3, 2, 1, 0, "b", 1, 0, 0, 1]) == {
        "a": PrefixHits(2, 1, 0), "b": PrefixHits(0, 0, 1)}
    assert decode_prefix_reply([]) == {}
    with pytest.raises(ValueError):
        decode_prefix_reply(["a", 4, 2, 1, 0])


@pytest.mark.redis
async def test_stored_and_removed_events_are_reflected(cluster: Cluster) -> None:
    a = await cluster.add()
    assert await cluster.index.longest_prefix(HASHES[:8]) == {}
    assert await cluster.publish(a, stored(0, 1, 2, 3, 4)) is ApplyStatus.APPLIED
    assert await cluster.index.longest_prefix(HASHES[:8]) == {a: 5}
    assert await cluster.index.longest_prefix(HASHES[:3]) == {a: 3}
    await cluster.publish(a, removed(2))
    assert await cluster.index.longest_prefix(HASHES[:8]) == {a: 2}
    await cluster.publish(a, removed(0))
    assert await cluster.index.longest_prefix(HASHES[:8]) == {}
    assert await cluster.index.longest_prefix([]) == {}


@pytest.mark.redis
async def test_longest_prefix_partial_overlap_across_three_instances(cluster: Cluster) -> None:
    a, b, c, d = [await cluster.add() for _ in range(4)]
    await cluster.publish(a, stored(*range(8)))
    await cluster.publish(b, stored(*range(4)))
    await cluster.publish(c, stored(0, 1, 4, 5, 6, 7))  # a hole at block 2
    await cluster.publish(d, stored(3, 4, 5))  # no first block: no usable prefix
    assert await cluster.index.longest_prefix(HASHES[:8]) == {a: 8, b: 4, c: 2}
    assert await cluster.index.longest_prefix(HASHES[:6]) == {a: 6, b: 4, c: 2}
    assert await cluster.index.longest_prefix(HASHES[:1]) == {a: 1, b: 1, c: 1}
    assert await cluster.index.longest_prefix(HASHES[8:12]) == {}  # nobody has block 8


async def commandstats(raw: aioredis.Redis) -> dict[str, int]:
    stats = await raw.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


@pytest.mark.redis
async def test_lookup_is_one_round_trip_and_stops_at_first_miss(
    cluster: Cluster, raw: aioredis.Redis
) -> None:
    a = await cluster.add()
    await cluster.publish(a, stored(0, 1, 2))
    await cluster.index.longest_prefix(HASHES[:2])  # warm up: loads the script once

    for n_hashes in (8, 64):
        before = await commandstats(raw)
        assert await cluster.index.longest_prefix(HASHES[:n_hashes]) == {a: 3}
        after = await commandstats(raw)
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        assert delta["evalsha"] == 1  # one round trip, whatever the prompt length
        # Server side: SMEMBERS of block 0 in each of the 3 media (paged, host and disk
        # tiers), then SMISMEMBER in each medium for blocks 1, 2 (hits) and 3 (the miss);
        # nothing past the first miss is read.
        assert delta["smembers"] == 3
        assert delta["smismember"] == 3 * 3
        unexpected = {
            k: v
            for k, v in delta.items()
            if v and k not in {"evalsha", "smembers", "smismember", "exists", "info"}
        }
        assert unexpected == {}


@pytest.mark.redis
async def test_sequence_gaps_and_duplicates_are_reported(cluster: Cluster) -> None:
    a = await cluster.add()
    index = cluster.index

    first = await index.apply(KVEventBatch(a, 0, [stored(0)]))
    assert (first.status, first.previous_seq, first.needs_snapshot) == (
        ApplyStatus.APPLIED,
        None,
        False,
    )
    assert (await index.apply(KVEventBatch(a, 1, [stored(1)]))).status is ApplyStatus.APPLIED

    dup = await index.apply(KVEventBatch(a, 1, [stored(2)]))
    assert dup.status is ApplyStatus.DUPLICATE and dup.previous_seq == 1
    assert await index.longest_prefix(HASHES[:4]) == {a: 2}  # the duplicate was ignored

    gap = await index.apply(KVEventBatch(a, 5, [stored(2)]))
    assert gap.status is ApplyStatus.GAP and gap.needs_snapshot and gap.previous_seq == 1
    assert await index.longest_prefix(HASHES[:4]) == {a: 3}  # still applied

    snapshot = KVEventBatch(a, 6, [AllBlocksCleared(), stored(0, 1, 2, 3)])
    assert (await index.apply(snapshot)).status is ApplyStatus.APPLIED
    assert await index.longest_prefix(HASHES[:8]) == {a: 4}


@pytest.mark.redis
async def test_all_blocks_cleared_removes_only_that_instance(
    cluster: Cluster, raw: aioredis.Redis
) -> None:
    a, b = await cluster.add(), await cluster.add()
    await cluster.publish(a, stored(0, 1, 2, 3))
    await cluster.publish(b, stored(0, 1))
    await cluster.publish(a, AllBlocksCleared())
    assert await cluster.index.longest_prefix(HASHES[:4]) == {b: 2}
    keys = cluster.index.keys
    assert not await raw.exists(keys.held(a))
    assert not await raw.exists(keys.block(HASHES[3]))  # emptied sets disappear
    await cluster.publish(a, stored(0))
    assert await cluster.index.longest_prefix(HASHES[:4]) == {a: 1, b: 2}


@pytest.mark.redis
async def test_events_from_unregistered_instance_are_refused(
    cluster: Cluster, raw: aioredis.Redis
) -> None:
    result = await cluster.index.apply(KVEventBatch("decode-ghost-1-0", 0, [stored(0)]))
    assert result.status is ApplyStatus.UNKNOWN_INSTANCE
    assert result.needs_register and result.needs_snapshot
    assert not await raw.exists(cluster.index.keys.block(HASHES[0]))


@pytest.mark.redis
async def test_expired_instance_drops_out_of_lookups_and_index(
    conn: RedisConnection, keyspace: KeySpace, raw: aioredis.Redis
) -> None:
    cluster = Cluster(conn, keyspace)
    short_lived = InstanceRegistry(conn, keyspace, ttl_s=1.0)
    a = await cluster.add(short_lived)
    b = await cluster.add()
    await cluster.publish(a, stored(0, 1, 2))
    await cluster.publish(b, stored(0))
    assert await cluster.index.longest_prefix(HASHES[:4]) == {a: 3, b: 1}

    async def a_gone() -> bool:
        return await cluster.index.longest_prefix(HASHES[:4]) == {b: 1}

    await wait_until(a_gone, timeout_s=10.0)
    # The lookup that met the dead holder purged it from the index and membership.
    keys = cluster.index.keys
    assert not await raw.exists(keys.held(a), keys.seq(a))
    assert await raw.smembers(keys.block(HASHES[0])) == {b}
    assert await raw.smembers(keys.members) == {b}
    # Late events from the dead instance cannot resurrect it.
    assert await cluster.publish(a, stored(0, 1)) is ApplyStatus.UNKNOWN_INSTANCE
    assert await cluster.index.longest_prefix(HASHES[:4]) == {b: 1}


@pytest.mark.redis
async def test_restart_behind_same_address_is_not_credited_with_old_blocks(
    cluster: Cluster,
) -> None:
    old = InstanceInfo.create(
        role="decode", address="127.0.0.1:45000", model=cluster.index.keys.model, scheme=SCHEME
    )
    await cluster.registry.register(old)
    await cluster.publish(old.instance_id, stored(0, 1, 2))
    new = InstanceInfo.create(
        role="decode", address="127.0.0.1:45000", model=cluster.index.keys.model, scheme=SCHEME
    )
    assert new.instance_id != old.instance_id
    assert await cluster.registry.register(new) == [old.instance_id]
    assert await cluster.index.longest_prefix(HASHES[:4]) == {}
    assert [i.instance_id for i in await cluster.registry.live_instances()] == [new.instance_id]


@pytest.mark.redis
class TestOutage:
    """Redis dies or hangs under a live client; the client fails fast and heals."""

    @pytest.fixture
    def server(self) -> Iterator[RedisServer]:
        with RedisServer() as server:
            yield server

    async def test_killed_redis_raises_quickly_and_recovers_on_restart(
        self, server: RedisServer
    ) -> None:
        keys = KeySpace(model="outage")
        conn = RedisConnection.from_url(server.url, op_timeout_s=0.5, retry_after_s=0.2)
        try:
            cluster = Cluster(conn, keys)
            a = await cluster.add()
            await cluster.publish(a, stored(0, 1))
            assert await cluster.index.longest_prefix(HASHES[:4]) == {a: 2}
            assert conn.healthy

            server.kill()
            start = time.monotonic()
            with pytest.raises(IndexUnavailable):
                await cluster.index.longest_prefix(HASHES[:4])
            assert time.monotonic() - start < 1.5
            assert not conn.healthy and conn.last_error
            start = time.monotonic()
            with pytest.raises(IndexUnavailable, match="unavailable"):
                await cluster.registry.live_instances()  # inside the fail-fast window
            assert time.monotonic() - start < 0.1

            with RedisServer(port=server.port):

                async def answers() -> bool:
                    try:
                        return await cluster.index.longest_prefix(HASHES[:4]) == {}
                    except IndexUnavailable:
                        return False

                await wait_until(answers, timeout_s=10.0)
                assert conn.healthy and conn.last_error is None
                # The new Redis lost everything: the engine is told to re-register.
                assert await cluster.publish(a, stored(0, 1)) is ApplyStatus.UNKNOWN_INSTANCE
                assert not await cluster.registry.heartbeat(a)
                b = await cluster.add()
                await cluster.publish(b, stored(0, 1, 2))
                assert await cluster.index.longest_prefix(HASHES[:4]) == {b: 3}
        finally:
            await conn.aclose()

    async def test_hung_redis_hits_the_deadline_and_recovers(self, server: RedisServer) -> None:
        conn = RedisConnection.from_url(server.url, op_timeout_s=0.3, retry_after_s=0.1)
        index = PrefixIndex(conn, KeySpace(model="hang"))
        assert server.pid is not None
        try:
            assert await index.longest_prefix(HASHES[:2]) == {}
            os.kill(server.pid, signal.SIGSTOP)
            try:
                start = time.monotonic()
                with pytest.raises(IndexUnavailable):
                    await index.longest_prefix(HASHES[:2])
                assert time.monotonic() - start < 1.5
            finally:
                os.kill(server.pid, signal.SIGCONT)

            async def answers() -> bool:
                try:
                    return await index.longest_prefix(HASHES[:2]) == {}
                except IndexUnavailable:
                    return False

            await wait_until(answers, timeout_s=10.0)
            assert conn.healthy
        finally:
            await conn.aclose()
