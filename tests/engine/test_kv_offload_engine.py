"""The KV offload tier on real weights: a working set of conversations larger than the paged
cache. Without a tier each conversation's prefix is evicted before its next turn and
recomputed; with the host tier (or a host tier of two blocks spilling to disk) the next turn
restores it: its cached tokens cover the prefix, the engine computes fewer prefill tokens, and
the greedy outputs equal the run without the tier token for token.

SmolLM2-135M in fp32 on CPU has 0.7 MiB blocks of 16 tokens, so 9 MiB is a 12-block cache;
three conversations of 96-token prefixes (6 blocks each) do not fit it at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdmesh.engine.frontend.llm import LLM
from pdmesh.engine.kv_events import BlockStored
from pdmesh.engine.outputs import RequestOutput
from pdmesh.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.weights]

PREFIX_TOKENS = 96
CONVERSATIONS = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prefix(conversation: int) -> list[int]:
    start = 1000 + 3000 * conversation
    return [start + 7 * i % 2500 for i in range(PREFIX_TOKENS)]


def turns() -> list[list[int]]:
    """Turn 1 of every conversation, then turn 2 of every one (its prefix plus new tokens)."""
    first = [[*prefix(c), 50 + c, 60 + c] for c in range(CONVERSATIONS)]
    second = [[*prefix(c), 70 + c, 80 + c, 90 + c] for c in range(CONVERSATIONS)]
    return first + second


def run(llm: LLM) -> list[RequestOutput]:
    """One turn at a time, as a chat would send them."""
    return [llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
            for ids in turns()]


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(name="baseline", scope="module")
def baseline_fixture() -> tuple[list[list[int]], list[int], int]:
    llm = LLM("smollm2", kv_cache_memory="9MiB", seed=0)
    assert llm.engine.core.num_total_blocks < CONVERSATIONS * PREFIX_TOKENS // 16
    outputs = run(llm)
    result = (tokens(outputs), [o.num_cached_tokens for o in outputs],
              llm.engine.core.scheduled_tokens)
    llm.engine.core.close()
    return result


def check_restored(llm: LLM, baseline: tuple[list[list[int]], list[int], int]) -> None:
    base_tokens, base_cached, base_computed = baseline
    outputs = run(llm)
    assert tokens(outputs) == base_tokens  # the same tokens, with or without the tier
    second = [o.num_cached_tokens for o in outputs[CONVERSATIONS:]]
    assert base_cached[CONVERSATIONS:] == [0] * CONVERSATIONS  # evicted without the tier
    assert second == [PREFIX_TOKENS] * CONVERSATIONS  # restored with it
    computed = llm.engine.core.scheduled_tokens
    assert computed == base_computed - CONVERSATIONS * PREFIX_TOKENS
    load = llm.engine.core.load()
    assert load.kv_offload_restored_tokens == CONVERSATIONS * PREFIX_TOKENS
    assert load.prefix_hit_tokens == CONVERSATIONS * PREFIX_TOKENS
    assert load.kv_offload_restore_failures == 0


def test_the_host_tier_restores_evicted_prefixes(baseline) -> None:
    llm = LLM("smollm2", kv_cache_memory="9MiB", seed=0, kv_offload_host_bytes="64MiB")
    check_restored(llm, baseline)
    core = llm.engine.core
    load = core.load()
    assert load.kv_offload_host_restored_blocks == CONVERSATIONS * PREFIX_TOKENS // 16
    assert load.kv_offload_disk_blocks == 0
    # A snapshot for the cluster index names both media: what is paged, what the tier holds.
    snapshot = core.kv_snapshot()
    by_medium = {e.medium: set(e.block_hashes) for e in snapshot if isinstance(e, BlockStored)}
    assert by_medium["paged"] == set(core.kv_manager.pool.cached)
    assert by_medium["host"] == set(core.kv_offload.entries)
    assert len(by_medium["host"]) == load.kv_offload_host_blocks > 0
    core.close()


def test_the_disk_tier_restores_what_the_host_tier_spilled(baseline, tmp_path: Path) -> None:
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2-135M, fp32
    llm = LLM("smollm2", kv_cache_memory="9MiB", seed=0,
              kv_offload_host_bytes=2 * block_bytes, kv_offload_disk_dir=str(tmp_path),
              kv_offload_disk_bytes="64MiB")
    assert llm.engine.core.kv_offload.block_bytes == block_bytes
    check_restored(llm, baseline)
    load = llm.engine.core.load()
    assert load.kv_offload_disk_restored_blocks > 0
    assert load.kv_offload_disk_saved_blocks > 0
    llm.engine.core.close()
    assert list(tmp_path.iterdir()) == []  # its own directory is gone
