"""The router's pool keeps registry-discovered instances through a Redis restart.

A Redis that comes back empty lists no instance until each engine's back-off lets it retry and
re-register; dropping them all at once would leave the router with nothing to route to for
those seconds. They keep their place for `rejoin_grace_s`, then the registry is believed again.
"""

from __future__ import annotations

import time

import pytest

from pdmesh.engine.block_hash import HashScheme
from pdmesh.kvstore.instance_registry import InstanceInfo, InstanceRegistry
from pdmesh.kvstore.redis_conn import RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace
from pdmesh.kvstore.redis_server import RedisServer
from pdmesh.router.instances import InstancePool, PoolSettings
from tests.redis_fixture import anyio_backend_fixture  # noqa: F401  (fixture by import)

pytestmark = [pytest.mark.anyio, pytest.mark.redis]
MODEL = "test/pool-rejoin"


async def test_instances_survive_an_empty_redis_for_the_grace_period() -> None:
    server = RedisServer().start()
    conn = RedisConnection.from_url(server.url, retry_after_s=0.0)
    keys = KeySpace(model=MODEL)
    registry = InstanceRegistry(conn, keys)
    pool = InstancePool(
        PoolSettings(model=MODEL, rpc_timeout_s=0.3, rejoin_grace_s=1.0), registry=registry
    )
    info = InstanceInfo.create(role="decode", address="127.0.0.1:9", model=MODEL,
                               scheme=HashScheme(block_size=16))
    restarted: RedisServer | None = None
    try:
        await registry.register(info)
        await pool.poll_once()
        assert [i.address for i in pool.instances()] == [info.address]

        server.kill()
        await pool.poll_once()
        assert not pool.index_available
        assert [i.address for i in pool.instances()] == [info.address]  # kept, as before

        restarted = RedisServer(port=server.port).start()  # back, and empty
        back_at = time.monotonic()
        await pool.poll_once()
        assert pool.index_available
        assert [i.address for i in pool.instances()] == [info.address]  # grace: kept

        deadline = back_at + 5.0
        while pool.instances() and time.monotonic() < deadline:
            await pool.poll_once()
        assert pool.instances() == []  # it never re-registered: gone after the grace
        assert time.monotonic() - back_at >= 1.0
    finally:
        await pool.stop()
        await conn.aclose()
        if restarted is not None:
            restarted.stop()
        server.stop()
