"""Fixtures for tests against a real redis-server; import them explicitly where needed.

Each fixture function is named `<fixture>_fixture` and registered under `name=<fixture>`,
so importing it does not shadow the test parameters that use it:

    from tests.redis_fixture import conn_fixture, redis_server_fixture  # noqa: F401
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import redis.asyncio as aioredis

from pdmesh.kvstore.redis_conn import RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace
from pdmesh.kvstore.redis_server import RedisServer


@pytest.fixture(name="redis_server", scope="module")
def redis_server_fixture() -> Iterator[RedisServer]:
    """One real redis-server per test module; tests isolate themselves by model namespace."""
    with RedisServer() as server:
        yield server


@pytest.fixture(name="anyio_backend")
def anyio_backend_fixture() -> str:
    return "asyncio"


@pytest.fixture(name="keyspace")
def keyspace_fixture(request: pytest.FixtureRequest) -> KeySpace:
    """A model namespace of the test's own, so tests sharing a server cannot interfere."""
    return KeySpace(model=f"test/{re.sub(r'[^A-Za-z0-9_.-]', '_', request.node.name)}")


@pytest.fixture(name="conn")
async def conn_fixture(redis_server: RedisServer) -> AsyncIterator[RedisConnection]:
    connection = RedisConnection.from_url(redis_server.url)
    yield connection
    await connection.aclose()


@pytest.fixture(name="raw")
async def raw_fixture(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A plain client for inspecting what the code under test wrote."""
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], *, timeout_s: float = 10.0, interval_s: float = 0.05
) -> None:
    """Poll `predicate` until it holds; fail the test at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s}s")
