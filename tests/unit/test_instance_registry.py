"""Instance registration, heartbeats, liveness and the scheme guard, against a real Redis."""

from __future__ import annotations

import math
import os

import pytest
import redis.asyncio as aioredis

from pdmesh.engine.block_hash import HashScheme
from pdmesh.kvstore.instance_registry import (
    InstanceInfo,
    InstanceRegistry,
    Role,
    SchemeMismatchError,
    describe_scheme_diff,
    new_instance_id,
    validate_load,
)
from pdmesh.kvstore.redis_conn import RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace
from tests.redis_fixture import (  # noqa: F401  (fixtures register by import)
    anyio_backend_fixture,
    conn_fixture,
    keyspace_fixture,
    raw_fixture,
    redis_server_fixture,
    wait_until,
)

pytestmark = pytest.mark.anyio

SCHEME = HashScheme(block_size=16)


def make_info(
    keys: KeySpace, port: int, *, role: Role = "decode", block_size: int = 16
) -> InstanceInfo:
    return InstanceInfo.create(
        role=role,
        address=f"127.0.0.1:{port}",
        model=keys.model,
        scheme=HashScheme(block_size=block_size),
        kv_address=f"127.0.0.1:{port + 1000}" if role == "prefill" else None,
    )


# --- pure parts -------------------------------------------------------------------------


@pytest.mark.fast
def test_new_instance_id_is_per_process_and_unique() -> None:
    first, second = new_instance_id("prefill"), new_instance_id("prefill")
    assert first != second
    assert first.startswith("prefill-") and f"-{os.getpid()}-" in first


@pytest.mark.fast
def test_info_validation() -> None:
    keys = KeySpace(model="m")
    good = make_info(keys, 1)
    assert good.block_size == 16 and good.scheme_fingerprint == SCHEME.fingerprint()
    with pytest.raises(ValueError, match="role"):
        InstanceInfo.create(role="router", address="a:1", model="m", scheme=SCHEME)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite"):
        validate_load({"kv_usage": math.nan})
    with pytest.raises(ValueError, match="finite"):
        validate_load({"running": True})  # type: ignore[dict-item]
    assert validate_load({"running": 2, "kv_usage": 0.5}) == {"running": 2, "kv_usage": 0.5}


@pytest.mark.fast
def test_fields_round_trip_and_malformed_fields_are_rejected() -> None:
    info = make_info(KeySpace(model="m"), 7, role="prefill")
    fields = info.to_fields()
    back = InstanceInfo.from_fields(info.instance_id, fields)
    assert back == info
    with pytest.raises(ValueError, match="malformed"):
        InstanceInfo.from_fields(info.instance_id, {**fields, "block_size": "x"})
    with pytest.raises(ValueError, match="malformed"):
        InstanceInfo.from_fields(info.instance_id, {**fields, "load": "[1]"})
    missing = {k: v for k, v in fields.items() if k != "role"}
    with pytest.raises(ValueError, match="malformed"):
        InstanceInfo.from_fields(info.instance_id, missing)


@pytest.mark.fast
def test_describe_scheme_diff_names_the_differing_parts() -> None:
    a = HashScheme(block_size=16).describe()
    b = HashScheme(block_size=32, algorithm="blake2b").describe()
    assert describe_scheme_diff(a, b) == "sha256 vs blake2b, bs=16 vs bs=32"


# --- against Redis ----------------------------------------------------------------------


@pytest.mark.redis
async def test_register_and_list_live_instances_by_role(
    conn: RedisConnection, keyspace: KeySpace
) -> None:
    registry = InstanceRegistry(conn, keyspace)
    decode = make_info(keyspace, 1)
    prefill = make_info(keyspace, 2, role="prefill")
    assert await registry.register(decode) == []
    assert await registry.register(prefill) == []

    live = await registry.live_instances()
    assert [i.instance_id for i in live] == sorted([decode.instance_id, prefill.instance_id])
    (got,) = await registry.live_instances(role="prefill")
    assert got.instance_id == prefill.instance_id
    assert got.kv_address == prefill.kv_address and got.address == prefill.address
    assert got.scheme_fingerprint == SCHEME.fingerprint() and got.block_size == 16
    assert got.heartbeat_at is not None and got.started_at == prefill.started_at
    assert await registry.live_instances(role="colocated") == []


@pytest.mark.redis
async def test_heartbeat_updates_load_and_extends_ttl(
    conn: RedisConnection, keyspace: KeySpace, raw: aioredis.Redis
) -> None:
    registry = InstanceRegistry(conn, keyspace, ttl_s=30.0)
    info = make_info(keyspace, 1)
    await registry.register(info)
    key = keyspace.instance(info.instance_id)
    await raw.pexpire(key, 500)  # as if most of the TTL had passed
    load = {"running": 3, "waiting": 1, "kv_usage": 0.25}
    assert await registry.heartbeat(info.instance_id, load)
    assert await raw.pttl(key) > 25_000
    (got,) = await registry.live_instances()
    assert got.load == load
    assert got.heartbeat_at is not None and got.heartbeat_at >= info.started_at


@pytest.mark.redis
async def test_heartbeat_of_unknown_instance_asks_to_register_again(
    conn: RedisConnection, keyspace: KeySpace, raw: aioredis.Redis
) -> None:
    registry = InstanceRegistry(conn, keyspace)
    assert not await registry.heartbeat("decode-nohost-1-deadbeef", {"running": 0})
    assert not await raw.exists(keyspace.instance("decode-nohost-1-deadbeef"))


@pytest.mark.redis
async def test_scheme_mismatch_is_refused_loudly(conn: RedisConnection, keyspace: KeySpace) -> None:
    registry = InstanceRegistry(conn, keyspace)
    first = make_info(keyspace, 1)
    await registry.register(first)
    odd = make_info(keyspace, 2, block_size=32)

    with pytest.raises(SchemeMismatchError) as caught:
        await registry.register(odd)
    message = str(caught.value)
    assert odd.scheme_fingerprint in message and first.scheme_fingerprint in message
    assert "bs=32 vs bs=16" in message and first.instance_id in message
    assert [i.instance_id for i in await registry.live_instances()] == [first.instance_id]

    # Another model is another cluster; it may hash differently.
    other_keys = KeySpace(model=keyspace.model + "-other")
    other = InstanceRegistry(conn, other_keys)
    await other.register(make_info(other_keys, 3, block_size=32))

    # Once no live instance uses the old scheme, the new one is accepted.
    assert await registry.deregister(first.instance_id)
    assert await registry.register(odd) == []


@pytest.mark.redis
async def test_wrong_model_is_rejected(conn: RedisConnection, keyspace: KeySpace) -> None:
    registry = InstanceRegistry(conn, keyspace)
    with pytest.raises(ValueError, match="model"):
        await registry.register(make_info(KeySpace(model="elsewhere"), 1))


@pytest.mark.redis
async def test_expired_instances_leave_routing_and_sweep_clears_membership(
    conn: RedisConnection, keyspace: KeySpace, raw: aioredis.Redis
) -> None:
    short = InstanceRegistry(conn, keyspace, ttl_s=1.0)
    long = InstanceRegistry(conn, keyspace, ttl_s=30.0)
    dying, staying = make_info(keyspace, 1), make_info(keyspace, 2)
    await short.register(dying)
    await long.register(staying)

    async def only_staying_live() -> bool:
        live = await long.live_instances()
        return [i.instance_id for i in live] == [staying.instance_id]

    await wait_until(only_staying_live, timeout_s=10.0)
    assert await raw.smembers(keyspace.members) == {dying.instance_id, staying.instance_id}
    assert await long.sweep() == [dying.instance_id]
    assert await raw.smembers(keyspace.members) == {staying.instance_id}
    assert await long.sweep() == []


@pytest.mark.redis
async def test_reregistration_keeps_membership_and_deregister_is_idempotent(
    conn: RedisConnection, keyspace: KeySpace
) -> None:
    registry = InstanceRegistry(conn, keyspace)
    info = make_info(keyspace, 1)
    await registry.register(info)
    await registry.register(info)
    assert [i.instance_id for i in await registry.live_instances()] == [info.instance_id]
    assert await registry.deregister(info.instance_id)
    assert not await registry.deregister(info.instance_id)
    assert await registry.live_instances() == []


@pytest.mark.redis
async def test_unreadable_registration_is_skipped(
    conn: RedisConnection, keyspace: KeySpace, raw: aioredis.Redis
) -> None:
    registry = InstanceRegistry(conn, keyspace)
    good = make_info(keyspace, 1)
    await registry.register(good)
    await raw.sadd(keyspace.members, "decode-bad-1-0")
    await raw.hset(keyspace.instance("decode-bad-1-0"), mapping={"role": "decode"})
    assert [i.instance_id for i in await registry.live_instances()] == [good.instance_id]
