"""Two engine cores move a prompt's KV over UCX themselves (`kvstore/connector/ucx_blocks.py`):
the prefill core's ucxx listener lends its blocks, the decode core pulls only those its own
prefix cache lacks straight into its cache, and decodes exactly what an undisturbed run
decodes; a pull whose grant was already spent fails and the request recomputes, same tokens.

Real weights (SmolLM2), in-thread cores, the source parameters handed over as the ucxx plane
(`kvstore/transfer/ucx_plane.py`) would hand them. Skipped where ucxx is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.frontend.llm_engine import LLMEngine
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.kvstore.connector import ucx_blocks
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.grant_mac import new_key
from pdmesh.kvstore.connector.source import KVSource, LoadResult
from tests.core_pulls import decode_with as pulled
from tests.core_pulls import granted, greedy, lend, run

pytestmark = [pytest.mark.slow, pytest.mark.weights,
              pytest.mark.skipif(ucx_blocks.unavailable_reason() is not None,
                                 reason="needs the ucxx package")]

PROMPT = "Rivers carve valleys over thousands of years, and the sea takes what they carry; " * 4
MAX_TOKENS = 10


def engine() -> LLMEngine:
    config = EngineConfig(model="smollm2", kv_cache_memory="48MiB", block_size=16,
                          engine_core_process=False)
    return LLMEngine(config, KVConnectorConfig(shared_cache=False, tcp=False, ucx=True,
                                               grant_secret=new_key()))


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[LLMEngine, LLMEngine]]:
    prefill, decode = engine(), engine()
    yield prefill, decode
    prefill.core.close()
    decode.core.close()


def export(prefill: LLMEngine, rid: str, ids: list[int], grant: str) -> tuple[int, KVSource]:
    """Prefill `ids` with export_kv; its first token and the ucxx source a decode core pulls."""
    lent = lend(prefill, rid, ids, greedy(MAX_TOKENS))
    address = prefill.core.connector.ucx_address
    assert address
    return lent.first, granted(prefill, lent.source, "ucxx", address, rid, grant)


def decode_with(decode: LLMEngine, rid: str, ids: list[int], first: int,
                source: KVSource) -> tuple[list[int], LoadResult]:
    return pulled(decode, rid, ids, first, source, greedy(MAX_TOKENS))


def test_pull_over_ucx_equals_undisturbed_run_and_pulls_only_missing_blocks(pair) -> None:
    prefill, decode = pair
    ids = prefill.tokenize(PROMPT)[1]
    if len(ids) % 16 == 0:  # a partial last block, never in a prefix cache
        ids = ids[:-1]
    reference = LLMEngine(EngineConfig(model="smollm2", kv_cache_memory="48MiB",
                                       engine_core_process=False))
    reference.add(EngineRequest("ref", ids, greedy(MAX_TOKENS)))
    want = run(reference)
    reference.core.close()

    half = ids[: (len(ids) // 32) * 16]  # whole blocks: the decode core caches them first
    decode.add(EngineRequest("warm", half, SamplingParams(temperature=0.0, max_tokens=1)))
    run(decode)
    first, source = export(prefill, "p1", ids, "g" * 32)
    got, load = decode_with(decode, "d1", ids, first, source)
    assert not load.error, load.error
    assert load.reused_blocks == len(half) // 16
    assert load.pulled_blocks == -(-len(ids) // 16) - load.reused_blocks >= 1
    assert got == want

    # The same source again: the decode core now holds every full block and pulls the partial
    # last one, which the sender core already served under this grant: refused, recomputed.
    got, load = decode_with(decode, "d2", ids, first, source)
    assert load.error and load.pulled_blocks == 0, load
    assert got == want
    assert prefill.core.release_kv("p1")
