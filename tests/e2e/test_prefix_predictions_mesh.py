"""Issue 25's E2E for the router's prefix predictions (real processes, Redis, SmolLM2 weights),
on a colocated mesh whose Redis index for its instance drifts behind its back:

- entries deleted mid-run, as a lost batch would lose them: the engine still holds the prefix,
  so the router's predictions turn into under-predictions
  (`pdmesh:router_prefix_predictions_total{outcome="under"}`); past the drift rule (8 misses of
  >= 2 blocks in 16 requests) the router asks the instance to re-publish, its next heartbeat
  answers with a snapshot, the index holds the prefix again and the next prediction is exact;
- stale entries added, as lost removals (or a cache reset the index missed) leave them: the
  index promises blocks the engine does not hold, the predictions are over-predictions, and
  the snapshot after the ask removes the stale entries.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.engine.block_hash import BlockHash, HashScheme, hash_token_blocks
from pdmesh.kvstore.instance_registry import InstanceRegistry
from pdmesh.kvstore.prefix_index import PrefixIndex
from pdmesh.kvstore.redis_conn import RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace
from pdmesh.router.prefix_predictions import DriftRule
from pdmesh.serve import LocalMesh, MeshConfig
from tests.polling import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

MODEL = "smollm2"
PREFIX = "This is a long story about the old stone bridge over the river. " * 8 + "\n"
RULE = DriftRule()  # the router's defaults
T = TypeVar("T")


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model_name")):
            s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture
def mesh() -> Iterator[LocalMesh]:
    """A mesh per test: asks are rate-limited per instance (`DriftRule.ask_interval_s`)."""
    with LocalMesh(MeshConfig(colocated=True, port=0)) as local:
        yield local


class Index:
    """The mesh's Redis index as a test sees it (each call on its own connection)."""

    def __init__(self, redis_url: str) -> None:
        self.url = redis_url
        self.keys = KeySpace(MODEL)

    async def _instance_id(self, conn: RedisConnection) -> str:
        [info] = await InstanceRegistry(conn, self.keys).live_instances()
        return info.instance_id

    def instance_id(self) -> str:
        return asyncio.run(self._with(self._instance_id))

    def held_blocks(self, hashes: list[BlockHash]) -> int:
        async def lookup(conn: RedisConnection) -> int:
            found = await PrefixIndex(conn, self.keys).longest_prefix(hashes)
            return sum(found.values())
        return asyncio.run(self._with(lookup))

    def lose_entries(self, instance_id: str) -> int:
        """Delete the instance's index entries behind the index's back (a drifted slice)."""
        async def drop(_: RedisConnection) -> int:
            raw = aioredis.Redis.from_url(self.url, decode_responses=True)
            try:
                held = self.keys.held(instance_id)
                members = await raw.smembers(held)
                for member in members:  # '<hex>' (paged) or '<h|d>:<hex>' (tiers)
                    medium, _, hex_hash = member.rpartition(":")
                    stem = {"": "blk:", "h": "blkh:", "d": "blkd:"}[medium]
                    await raw.srem(self.keys.prefix + stem + hex_hash, instance_id)
                await raw.delete(held)
                return len(members)
            finally:
                await raw.aclose()
        return asyncio.run(self._with(drop))

    def add_stale(self, instance_id: str, hashes: list[BlockHash]) -> None:
        """Credit the instance with paged blocks it never held (lost removals)."""
        async def add(_: RedisConnection) -> None:
            raw = aioredis.Redis.from_url(self.url, decode_responses=True)
            try:
                for h in hashes:
                    await raw.sadd(self.keys.block(h), instance_id)
                    await raw.sadd(self.keys.held(instance_id), h.hex())
            finally:
                await raw.aclose()
        asyncio.run(self._with(add))

    async def _with(self, op: Callable[[RedisConnection], Awaitable[T]]) -> T:
        conn = RedisConnection.from_url(self.url)
        try:
            return await op(conn)
        finally:
            await conn.aclose()


class Mesh:
    """The mesh's HTTP API and router metrics, as the tests use them."""

    def __init__(self, local: LocalMesh) -> None:
        assert local.gateway_url is not None
        self.url = local.gateway_url
        self.router_metrics = local.metrics_urls()["router"]
        self.index = Index(local.redis_url)

    def complete(self, prompt: str) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        resp = httpx.post(f"{self.url}/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text

    def prefix_hashes(self, text: str) -> list[BlockHash]:
        """The block hashes of `text`'s whole blocks that the engine could hit (as a prompt's
        start: the engine leaves the last token of a prompt to compute)."""
        resp = httpx.post(self.url.removesuffix("/v1") + "/tokenize",
                          json={"model": MODEL, "prompt": text}, timeout=30)
        ids = resp.json()["tokens"]
        return hash_token_blocks(HashScheme(block_size=16), ids)[:(len(ids) - 1) // 16]

    def metric(self, name: str, **labels: str) -> float:
        return scrape(self.router_metrics).get((name, frozenset(labels.items())), 0.0)

    def predictions(self, instance_id: str, outcome: str) -> float:
        return self.metric("pdmesh:router_prefix_predictions_total", instance=instance_id,
                           outcome=outcome)

    def asks(self, instance_id: str) -> float:
        return self.metric("pdmesh:router_prefix_republish_asks_total", instance=instance_id,
                           outcome="sent")


def test_a_lost_index_slice_is_seen_asked_for_and_restored(mesh: LocalMesh) -> None:
    client = Mesh(mesh)
    index = client.index
    hashes = client.prefix_hashes(PREFIX)
    assert len(hashes) >= 2 * RULE.min_blocks
    client.complete(PREFIX + "Question: who built it?")
    wait_for(lambda: index.held_blocks(hashes) == len(hashes), "prefix indexed")
    instance_id = index.instance_id()
    client.complete(PREFIX + "Question: when?")
    assert client.predictions(instance_id, "exact") >= 1

    # The index loses the instance's entries; the engine's cache still holds the prefix.
    assert index.lose_entries(instance_id) >= len(hashes)
    assert index.held_blocks(hashes) == 0
    for i in range(RULE.misses):
        client.complete(PREFIX + f"Question number {i}: why?")
    assert client.predictions(instance_id, "under") >= RULE.misses
    assert client.metric("pdmesh:router_prefix_prediction_error_tokens_sum",
                         instance=instance_id) >= RULE.misses * len(hashes) * 16
    wait_for(lambda: client.asks(instance_id), "asked to re-publish")  # a background task
    assert client.asks(instance_id) == 1

    # The instance's heartbeat finds the ask and re-publishes: the index recovers.
    wait_for(lambda: index.held_blocks(hashes) == len(hashes), "prefix re-published",
             timeout_s=30)
    exact = client.predictions(instance_id, "exact")
    client.complete(PREFIX + "Question: and then?")
    assert client.predictions(instance_id, "exact") == exact + 1


def test_stale_index_entries_are_over_predictions_until_the_snapshot_drops_them(
        mesh: LocalMesh) -> None:
    client = Mesh(mesh)
    index = client.index
    client.complete("Warm up: hello")
    instance_id = index.instance_id()
    stories = [f"Story number {i}. " + PREFIX for i in range(RULE.misses)]
    never_sent = client.prefix_hashes("A story nobody asked for. " + PREFIX)
    stale = [client.prefix_hashes(story) for story in stories]
    for hashes in [*stale, never_sent]:
        index.add_stale(instance_id, hashes)
    assert index.held_blocks(never_sent) == len(never_sent)

    for story in stories:  # each promised its prefix, none of it held: all computed
        client.complete(story + "Question: who?")
    assert client.predictions(instance_id, "over") == RULE.misses
    wait_for(lambda: client.asks(instance_id), "asked to re-publish")  # a background task
    assert client.asks(instance_id) == 1

    # The snapshot clears the instance's slice and re-publishes what it holds: the stories it
    # has computed since, not the prefix it never held.
    wait_for(lambda: index.held_blocks(never_sent) == 0, "stale entries dropped", timeout_s=30)
    assert all(index.held_blocks(hashes) == len(hashes) for hashes in stale)
