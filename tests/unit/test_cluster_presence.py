"""ClusterPresence through a Redis outage, against a real redis-server that dies and returns.

The defect this guards (issue 12, item 1): a failed heartbeat left the next-heartbeat time in
the past, so the loop retried with no wait at all and every idle engine burned a full core
while Redis was down, still claiming `index_up` 1. Wanted: bounded back-off with jitter,
`registered` False while Redis is gone, and re-registration plus a fresh snapshot of the
blocks held when Redis comes back — even empty, as a restarted Redis does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import pytest

from pdmesh.engine.block_hash import BlockHash, HashScheme, hash_token_blocks
from pdmesh.engine.kv_events import AllBlocksCleared, BlockStored, KVEvent
from pdmesh.engine_svc.presence import Backoff, ClusterPresence
from pdmesh.kvstore.instance_registry import InstanceInfo, InstanceRegistry
from pdmesh.kvstore.prefix_index import PrefixIndex
from pdmesh.kvstore.redis_conn import IndexUnavailable, RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace
from pdmesh.kvstore.redis_server import RedisServer
from tests.redis_fixture import (  # noqa: F401  (fixtures register by import)
    anyio_backend_fixture,
    wait_until,
)

pytestmark = pytest.mark.anyio

SCHEME = HashScheme(block_size=16)
MODEL = "test/cluster-presence"


class HeldBlocks:
    """What an engine's block pool would report: the hashes it holds, and new ones as events.

    Counts how often the presence loop asks for its load (every register and heartbeat
    attempt does), which is how the tests see how often Redis is tried."""

    def __init__(self, hashes: list[BlockHash]) -> None:
        self.held: list[BlockHash] = list(hashes)
        self.pending: list[KVEvent] = []
        self.load_calls = 0
        self.events_ready = asyncio.Event()

    def load(self) -> dict[str, float]:
        self.load_calls += 1
        return {"running": 0.0, "waiting": 0.0}

    async def take_events(self) -> list[KVEvent]:
        events, self.pending = self.pending, []
        return events

    async def snapshot(self) -> list[KVEvent]:
        self.pending = []
        return [AllBlocksCleared(), BlockStored(tuple(self.held))]

    def store(self, hashes: list[BlockHash]) -> None:
        self.held += hashes
        self.pending.append(BlockStored(tuple(hashes)))
        self.events_ready.set()


@pytest.fixture(name="server")
def server_fixture() -> Iterator[RedisServer]:
    """A server of this test's own: the test kills it."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.fast
def test_backoff_doubles_to_a_bound_with_jitter() -> None:
    import random

    backoff = Backoff(initial_s=0.5, max_s=5.0, rng=random.Random(7))
    delays = [backoff.next_delay() for _ in range(12)]
    for attempt, delay in enumerate(delays):
        nominal = min(5.0, 0.5 * 2**attempt)
        assert nominal / 2 <= delay <= nominal
    assert len(set(delays)) == len(delays)  # jittered, not lockstep
    assert max(delays) <= 5.0
    backoff.reset()
    assert backoff.next_delay() <= 0.5


@pytest.mark.redis
async def test_outage_backs_off_then_reregisters_and_republishes(server: RedisServer) -> None:
    keys = KeySpace(model=MODEL)
    first = hash_token_blocks(SCHEME, list(range(64)))  # 4 blocks
    later = hash_token_blocks(SCHEME, list(range(1000, 1032)))  # 2 blocks cached mid-outage
    blocks = HeldBlocks(first)
    info = InstanceInfo.create(role="decode", address="127.0.0.1:1", model=MODEL, scheme=SCHEME)
    conn = RedisConnection.from_url(server.url)
    observer = RedisConnection.from_url(server.url)
    index, registry = PrefixIndex(observer, keys), InstanceRegistry(observer, keys)
    changes: list[bool] = []

    async def on_change(up: bool, detail: str) -> None:
        changes.append(up)
        assert up or "redis" in detail

    presence = ClusterPresence(
        conn, info, load=blocks.load, take_events=blocks.take_events,
        snapshot=blocks.snapshot, events_ready=blocks.events_ready, ttl_s=3.0,
        on_change=on_change,
    )
    try:
        assert await presence.try_register()
        presence.start()

        async def indexed(hashes: list[BlockHash]) -> bool:
            try:
                return (await index.longest_prefix(hashes)).get(info.instance_id) == len(hashes)
            except IndexUnavailable:
                return False

        await wait_until(lambda: indexed(first), timeout_s=5)  # the first snapshot
        assert presence.registered and changes == [True]

        server.kill()
        blocks.store(later)  # wakes the loop: its publish meets the dead Redis at once

        async def down() -> bool:
            return not presence.registered

        await wait_until(down, timeout_s=5)
        assert presence.detail and changes == [True, False]

        # While Redis is down the loop must back off, not spin: count Redis attempts and the
        # CPU this process burns over a window (the old loop retried with a zero wait).
        calls, cpu, started = blocks.load_calls, time.process_time(), time.monotonic()
        await asyncio.sleep(3.0)
        attempts = blocks.load_calls - calls
        cpu_s = time.process_time() - cpu
        window = time.monotonic() - started
        assert attempts <= 6, f"{attempts} Redis attempts in {window:.1f}s: the loop spins"
        assert cpu_s < 0.5 * window, f"{cpu_s:.2f}s CPU in {window:.1f}s: the loop spins"
        assert not presence.registered

        # A fresh, empty Redis on the same port (what a restarted pod gives): the instance
        # must register again and republish everything it holds, new blocks included.
        restarted = RedisServer(port=server.port).start()
        try:
            async def back() -> bool:
                live = []
                with contextlib.suppress(IndexUnavailable):
                    live = await registry.live_instances()
                return (presence.registered
                        and any(i.instance_id == info.instance_id for i in live)
                        and await indexed(first) and await indexed(later))

            await wait_until(back, timeout_s=10)  # re-registered, fresh snapshot
            assert changes == [True, False, True]
            assert presence.detail == ""
        finally:
            await presence.stop()
            restarted.stop()
    finally:
        await presence.stop()
        await conn.aclose()
        await observer.aclose()
