"""Cluster-wide prefix caching between two engine cores: the core that holds a prompt's
leading blocks (a conversation's earlier turn, prompt and answer) lends them, and the core that
computes the prompt pulls the ones its own prefix cache lacks before computing only the rest.
Output equals an undisturbed run's, a pull that fails computes the prompt whole, and every
pinned block comes back.

Real weights (SmolLM2), in-thread cores; the serving processes' control plane is covered by the
end-to-end tests (tests/e2e/test_kv_peer_reuse.py), here the cores get the source it would
hand them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
import pytest

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.frontend.async_engine import AsyncEngine
from pdmesh.engine.frontend.llm_engine import LLMEngine
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.export_info import PrefixLoan
from pdmesh.kvstore.connector.grant_mac import new_key
from pdmesh.kvstore.connector.source import KVSource, encode_blocks
from tests.core_pulls import greedy, run

pytestmark = [pytest.mark.slow, pytest.mark.weights]

TURN1 = ("User: The history of the printing press begins in the fifteenth century, when a "
         "goldsmith in Mainz combined movable metal type, oil-based ink and a screw press. "
         "Tell me more.\nAssistant:")
TURN2 = "\nUser: And what came after that in the sixteenth century?\nAssistant:"
ANSWER_TOKENS = 40
MAX_TOKENS = 10
BLOCK = 16


def engine() -> LLMEngine:
    config = EngineConfig(model="smollm2", kv_cache_memory="48MiB", block_size=BLOCK,
                          engine_core_process=False)
    return LLMEngine(config, KVConnectorConfig(tcp=False, grant_secret=new_key()))


@pytest.fixture(scope="module")
def cores() -> Iterator[tuple[LLMEngine, LLMEngine]]:
    holder, target = engine(), engine()
    yield holder, target
    holder.core.close()
    target.core.close()


def conversation(holder: LLMEngine, rid: str) -> tuple[list[int], list[int]]:
    """Turn 1 run on the holder (its prompt and answer now cached there); turn 2's prompt
    (turn 1, its answer, the next question) and turn 1's prompt. Each `rid` its own
    conversation (the cores are shared by the module's tests)."""
    turn1 = holder.tokenize(f"Conversation {rid}. {TURN1}")[1]
    holder.add(EngineRequest(rid, turn1, greedy(ANSWER_TOKENS)))
    answer = run(holder)
    return turn1 + answer + holder.tokenize(TURN2)[1], turn1


def source_of(holder: LLMEngine, loan: PrefixLoan) -> KVSource:
    """What the holder's control plane would hand a same-host puller (shm)."""
    facts = holder.core.info()
    params = {"cache": facts.kv_cache_file, "num_blocks": str(facts.num_total_blocks),
              "blocks": encode_blocks(loan.block_ids)}
    return KVSource("shm", params, loan.block_checksums, loan.checksum_algo,
                    len(loan.block_ids) * BLOCK, facts.kv_shape, facts.kv_dtype)


def reference(ids: list[int]) -> list[int]:
    ref = LLMEngine(EngineConfig(model="smollm2", kv_cache_memory="48MiB", block_size=BLOCK,
                                 engine_core_process=False))
    try:
        ref.add(EngineRequest("ref", ids, greedy(MAX_TOKENS)))
        return run(ref)
    finally:
        ref.core.close()


def test_lent_prefix_is_pulled_and_only_the_rest_computed(cores) -> None:
    holder, target = cores
    turn2, _ = conversation(holder, "c1")
    held = (len(turn2) - 1) // BLOCK  # the whole answer's blocks are cached too
    free_before = holder.core.num_free_blocks
    loan = holder.core.lend_prefix("lend-1", turn2, None)
    assert len(loan.block_ids) >= held - 1 and len(loan.block_checksums) == len(loan.block_ids)
    assert holder.core.exports.pinned_blocks() == len(loan.block_ids)

    hits_before = target.core.kv_manager.stats.hits
    state = target.add(EngineRequest("t1", turn2, greedy(MAX_TOKENS),
                                     prefix_source=source_of(holder, loan)))
    got = run(target)
    assert state.kv_load is not None and not state.kv_load.error, state.kv_load
    assert (state.kv_load.reused_blocks, state.kv_load.pulled_blocks) == (0, len(loan.block_ids))
    # The scheduler found the pulled blocks as prefix hits: only the rest was computed.
    assert target.core.kv_manager.stats.hits - hits_before == len(loan.block_ids) * BLOCK
    assert got == reference(turn2)

    assert holder.core.release_kv("lend-1")
    assert not holder.core.release_kv("lend-1")  # exactly once
    assert holder.core.exports.pinned_blocks() == 0
    assert holder.core.num_free_blocks == free_before


def test_only_blocks_the_target_lacks_are_pulled(cores) -> None:
    holder, target = cores
    turn2, turn1 = conversation(holder, "c2")
    # The target computed turn 1's prompt itself (a prefill instance): it holds those blocks.
    target.add(EngineRequest("t-turn1", turn1, greedy(1)))
    run(target)
    loan = holder.core.lend_prefix("lend-2", turn2, None)
    state = target.add(EngineRequest("t2", turn2, greedy(MAX_TOKENS),
                                     prefix_source=source_of(holder, loan)))
    got = run(target)
    assert state.kv_load is not None and not state.kv_load.error, state.kv_load
    reused = len(turn1) // BLOCK
    assert state.kv_load.reused_blocks == reused
    assert state.kv_load.pulled_blocks == len(loan.block_ids) - reused
    assert got == reference(turn2)
    assert holder.core.release_kv("lend-2")


def test_a_corrupt_block_fails_the_pull_and_the_prompt_is_computed_whole(cores) -> None:
    holder, target = cores
    turn2, _ = conversation(holder, "c3")
    loan = holder.core.lend_prefix("lend-3", turn2, None)
    source = source_of(holder, loan)
    bad = list(source.block_checksums)
    bad[-1] ^= 1
    free_before = target.core.num_free_blocks
    state = target.add(EngineRequest("t3", turn2, greedy(MAX_TOKENS),
                                     prefix_source=msgspec.structs.replace(
                                         source, block_checksums=bad)))
    got = run(target)
    assert state.kv_load is not None and state.kv_load.error
    assert state.kv_load.reason == "checksum"
    assert got == reference(turn2)
    assert target.core.num_free_blocks == free_before  # nothing pinned, nothing leaked
    assert holder.core.release_kv("lend-3")


def test_a_holder_without_enough_blocks_lends_nothing_and_keeps_nothing(cores) -> None:
    holder, _ = cores
    ids = holder.tokenize("An unrelated prompt that nobody has computed before, at all.")[1]
    loan = holder.core.lend_prefix("lend-4", ids, None)
    assert loan.block_ids == [] and "lend-4" not in holder.core.exports.lent
    turn2, _ = conversation(holder, "c4")
    loan = holder.core.lend_prefix("lend-5", turn2, None, min_blocks=1000)
    assert loan.block_ids == [] and holder.core.exports.pinned_blocks() == 0
    assert not any(k.startswith("lend-") for k in holder.core.kv_manager._hashes)
    with pytest.raises(ValueError, match="prefix_source"):
        holder.add(EngineRequest("x", ids, greedy(2), prefix_source=KVSource(
            "shm", {}, [], "crc32c", len(ids) + 5, (1, 1, 1, 1), "float32")))


@pytest.mark.anyio
async def test_a_lend_cancelled_while_the_core_answers_keeps_nothing_pinned(cores) -> None:
    """The KVPeer call that asked went away while the core made the loan: nobody would publish
    it, so no lease would ever end it; the loan is released behind the command instead."""
    holder, _ = cores
    turn2, _ = conversation(holder, "c9")
    engine = AsyncEngine(holder)
    try:
        for attempt in range(3):
            lend = asyncio.ensure_future(engine.lend_prefix(f"lend-9-{attempt}", turn2, None))
            await asyncio.sleep(0)  # the command is out; its answer is awaited
            lend.cancel()
            with pytest.raises(asyncio.CancelledError):
                await lend
        # Each cancel sent its release after the lend: a command behind them all is answered
        # after they ran.
        await engine.kv_snapshot()
        assert engine.load().num_pinned_blocks == 0
        assert not holder.core.exports.lent
    finally:
        await engine.shutdown()
