"""Issue 25's E2E for the offload tier: a KV budget too small for a working set of
conversations (`pdmesh serve --colocated --kv-cache-memory 9MiB --kv-offload-host-bytes 64MiB`,
real processes, Redis, SmolLM2 weights). Each conversation's first turn evicts the others'
prefixes from the 12-block paged cache into the host tier; their second turns restore them
(the engine's offload metrics count the restores, its prefix-hit counter the tokens) and
compute fewer prefill tokens than an engine without the tier, with the same greedy text.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh import LLM, SamplingParams
from pdmesh.engine.block_hash import HashScheme, hash_token_blocks
from pdmesh.engine.config import EngineConfig
from pdmesh.kvstore.prefix_index import PrefixHits, PrefixIndex
from pdmesh.kvstore.redis_conn import RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace
from pdmesh.serve import LocalMesh, MeshConfig
from tests.polling import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

KV_MEMORY = "9MiB"  # 12 blocks of 16 tokens for SmolLM2-135M in fp32
TOPICS = ("the old stone bridge over the river", "the lighthouse keeper on the northern cape",
          "the orchard behind the abbey walls")


def conversation(topic: str) -> str:
    """A long shared first part (about 7 blocks) for every turn of one conversation."""
    return (f"This is a long story about {topic}. " * 9) + "\n"


def turns() -> list[str]:
    first = [conversation(t) + "Question: who built it?" for t in TOPICS]
    second = [conversation(t) + "Question: what happened next?" for t in TOPICS]
    return first + second


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model_name")):
            s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture(scope="module")
def mesh() -> Iterator[LocalMesh]:
    config = MeshConfig(colocated=True, port=0, kv_cache_memory=KV_MEMORY,
                        engine=EngineConfig(kv_offload_host_bytes="64MiB"))
    with LocalMesh(config) as local:
        yield local


def test_evicted_prefixes_come_back_from_the_host_tier(mesh: LocalMesh) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    baseline = LLM("smollm2", kv_cache_memory=KV_MEMORY)
    assert baseline.engine.core.num_total_blocks == 12
    expected = [baseline.generate(p, params, use_tqdm=False)[0] for p in turns()]
    baseline_computed = baseline.engine.core.scheduled_tokens
    assert [o.num_cached_tokens for o in expected[len(TOPICS):]] == [0] * len(TOPICS)

    assert mesh.gateway_url is not None
    texts = []
    for prompt in turns():
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        resp = httpx.post(f"{mesh.gateway_url}/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        texts.append(resp.json()["choices"][0]["text"])
    assert texts == [o.outputs[0].text for o in expected]  # the same tokens as without a tier

    # The index knows conversation 0's prefix is in the engine's host tier now (conversations
    # 1 and 2 evicted it from the paged cache again after its second turn restored it).
    _, ids = baseline.engine.tokenize(conversation(TOPICS[0]))
    hashes = hash_token_blocks(HashScheme(block_size=16), ids)[:6]

    async def hits() -> list[PrefixHits]:
        conn = RedisConnection.from_url(mesh.redis_url)
        try:
            found = await PrefixIndex(conn, KeySpace("smollm2")).longest_prefix_by_medium(hashes)
            return list(found.values())
        finally:
            await conn.aclose()

    wait_for(lambda: [h.blocks for h in asyncio.run(hits())] == [6], "prefix indexed")
    assert asyncio.run(hits())[0].host > 0

    got = scrape(mesh.metrics_urls()["colocated-0"])
    role = ("role", "colocated")
    host = frozenset({role, ("medium", "host")})
    restored = got[("pdmesh:kv_offload_restored_blocks_total", host)]
    assert restored >= len(TOPICS) * 6  # each second turn restored its first 6+ blocks
    assert got[("pdmesh:kv_offload_prefill_tokens_saved_total", frozenset({role}))] \
        == restored * 16
    assert got[("pdmesh:prefix_cache_hits_total", frozenset({role}))] >= restored * 16
    assert got[("pdmesh:kv_offload_restore_failures_total", frozenset({role}))] == 0
    computed = got[("pdmesh:engine_scheduled_tokens_total", frozenset({role}))]
    assert computed <= baseline_computed - restored * 16
