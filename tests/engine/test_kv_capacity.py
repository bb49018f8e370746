"""n > 1 requests against a small KV pool, on real weights: refuse what can never fit, let
forks that do not fit *right now* wait, and leave no block or sequence behind on any path.

The pool is ~11 blocks of 16 tokens (SmolLM2-135M, fp32 on CPU); "hog" requests with long
prompts fill it so imports and forks meet a full pool. Sizes are derived from the engine's own
block count, so the tests hold whatever the device and dtype.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import torch

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.engine_request import EngineRequest, KVCacheFullError
from pdmesh.engine.frontend.async_engine import AsyncEngine, EngineError
from pdmesh.engine.frontend.llm_engine import LLMEngine
from pdmesh.engine.outputs import RequestOutput
from pdmesh.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.weights]

PROMPT = list(range(2000, 2020))  # 20 tokens: one full block and a partial one
MAX_TOKENS = 6


@pytest.fixture(name="engine", scope="module")
def engine_fixture() -> Iterator[LLMEngine]:
    yield LLMEngine(EngineConfig(model="smollm2", kv_cache_memory="8MiB", seed=0))


@pytest.fixture(autouse=True)
def _clean_engine(engine: LLMEngine) -> Iterator[None]:
    """Every test starts and must end with an empty engine and a full pool."""
    assert_clean(engine)
    yield
    for request_id in list(engine.requests):
        engine.abort_request(request_id)


def assert_clean(engine: LLMEngine) -> None:
    assert engine.num_free_blocks == engine.num_total_blocks
    assert not engine.scheduler.running and not len(engine.scheduler.waiting)
    assert not engine.requests


def greedy(n: int = 1, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, n=n, max_tokens=max_tokens, ignore_eos=True)


def run_until_done(engine: LLMEngine, max_steps: int = 500) -> dict[str, RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    raise AssertionError(f"engine still busy after {max_steps} steps")


def export(engine: LLMEngine, params: SamplingParams) -> tuple[list[int], torch.Tensor]:
    """Prefill PROMPT as the prefill role would: first tokens and a copy of the KV."""
    engine.add_request("export", {"prompt_token_ids": PROMPT}, params, export_kv=True)
    for _ in range(50):
        outs = [o for o in engine.step() if o.kv_export is not None]
        if outs:
            first = [c.token_ids[0] for c in sorted(outs[0].outputs, key=lambda c: c.index)]
            kv = engine.read_kv("export").clone()
            assert engine.release_kv("export")
            return first, kv
    raise AssertionError("export did not finish")


def imported(request_id: str, first: list[int], kv: torch.Tensor, params: SamplingParams,
             num_cached_tokens: int = 0) -> EngineRequest:
    """PROMPT continued from its exported KV and first tokens (the decode role)."""
    return EngineRequest(request_id, PROMPT, params, kv=kv, given_tokens=[[t] for t in first],
                         num_cached_tokens=num_cached_tokens)


def add_hog(engine: LLMEngine, request_id: str, num_blocks: int) -> None:
    """A running request holding `num_blocks` blocks (its prompt ends inside the last one)."""
    ids = [1000 + i for i in range(num_blocks * engine.config.block_size - 8)]
    engine.add_request(request_id, {"prompt_token_ids": ids}, greedy(max_tokens=4))
    engine.step()  # the whole prompt in one step: it holds its blocks now
    seq = engine.core.requests[request_id].seqs[0]
    assert engine.kv_manager.block_ids(seq.seq_id), "hog was not scheduled"


def reference(engine: LLMEngine) -> list[int]:
    engine.add_request("reference", {"prompt_token_ids": PROMPT}, greedy())
    out = run_until_done(engine)["reference"]
    return list(out.outputs[0].token_ids)


def request_blocks(num_prompt: int, max_tokens: int, n: int, block_size: int) -> int:
    """Blocks an n-sample request holds at its peak: shared prompt blocks + each sample's own."""
    shared = num_prompt // block_size
    return shared + n * (-(-(num_prompt + max_tokens) // block_size) - shared)


def largest_fitting_n(engine: LLMEngine) -> int:
    bs = engine.config.block_size
    return max(n for n in range(1, 200)
               if request_blocks(len(PROMPT), MAX_TOKENS, n, bs) <= engine.num_total_blocks)


# -- refusal ----------------------------------------------------------------------------------
def test_a_request_that_can_never_fit_is_refused_before_anything_is_allocated(
    engine: LLMEngine,
) -> None:
    n = largest_fitting_n(engine) + 1
    with pytest.raises(KVCacheFullError, match=rf"n={n}.*{engine.num_total_blocks} blocks"):
        engine.add_request("big", {"prompt_token_ids": PROMPT}, greedy(n=n))
    assert_clean(engine)
    first, kv = export(engine, greedy(n=n))
    with pytest.raises(KVCacheFullError, match=rf"n={n}"):
        engine.add(imported("big-import", first, kv, greedy(n=n)))
    assert_clean(engine)
    # The prefill role only ever holds the prompt: the same request may export.
    assert len(first) == n


def test_max_tokens_none_counts_the_rest_of_the_context(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.0, n=2, max_tokens=None)
    with pytest.raises(KVCacheFullError, match="max_tokens"):
        engine.add_request("unbounded", {"prompt_token_ids": PROMPT}, params)
    assert_clean(engine)


# -- waiting for room -------------------------------------------------------------------------
def test_import_whose_forks_do_not_fit_right_now_waits_and_finishes(engine: LLMEngine) -> None:
    want = reference(engine)
    n = 4
    first, kv = export(engine, greedy(n=n))
    # Leave room for the imported prompt (2 blocks) and a single copy-on-write block.
    add_hog(engine, "hog", engine.num_free_blocks - 3)
    engine.add(imported("imp", first, kv, greedy(n=n)))
    assert len(engine.scheduler.waiting) >= n - 2  # the forks that found no block wait
    outs = run_until_done(engine)
    assert {c.index: list(c.token_ids) for c in outs["imp"].outputs} == {
        i: want for i in range(n)}
    assert_clean(engine)


def test_import_with_no_room_for_its_prompt_waits_and_recomputes(engine: LLMEngine) -> None:
    want = reference(engine)
    n = 3
    first, kv = export(engine, greedy(n=n))
    add_hog(engine, "hog", engine.num_free_blocks)  # the pool is full
    assert engine.num_free_blocks == 0
    engine.add(imported("imp", first, kv, greedy(n=n), num_cached_tokens=16))
    outs = run_until_done(engine)
    assert {c.index: list(c.token_ids) for c in outs["imp"].outputs} == {
        i: want for i in range(n)}
    assert outs["imp"].num_cached_tokens == 16  # as the prefill reported it
    assert_clean(engine)


def test_abort_while_forks_wait_frees_every_block_and_sequence(engine: LLMEngine) -> None:
    n = 4
    first, kv = export(engine, greedy(n=n))
    add_hog(engine, "hog", engine.num_free_blocks - 3)
    engine.add(imported("imp", first, kv, greedy(n=n)))
    engine.step()
    assert engine.abort_request("imp")
    assert engine.abort_request("hog")
    assert_clean(engine)


def test_colocated_n_gt_1_with_forks_waiting_finishes_clean(engine: LLMEngine) -> None:
    n = largest_fitting_n(engine)
    add_hog(engine, "hog", engine.num_free_blocks - 3)
    engine.add_request("co", {"prompt_token_ids": PROMPT}, greedy(n=n))
    outs = run_until_done(engine)
    assert sorted(len(c.token_ids) for c in outs["co"].outputs) == [MAX_TOKENS] * n
    assert_clean(engine)


# -- through the AsyncEngine: cancel and deadline while forks wait ----------------------------
@pytest.mark.anyio
async def test_cancel_and_deadline_while_forks_wait_leave_nothing_behind(
    engine: LLMEngine,
) -> None:
    n, long = 3, 28  # one such request fits the pool, two at once do not
    bs, total = engine.config.block_size, engine.num_total_blocks
    assert request_blocks(len(PROMPT), long, n, bs) <= total
    assert 2 * request_blocks(len(PROMPT), long, n, bs) > total
    first, kv = export(engine, greedy(n=n))
    aengine = AsyncEngine(engine)
    try:
        async def consume(request_id: str, max_tokens: int) -> RequestOutput | None:
            last = None
            async for out in aengine.add(imported(request_id, first, kv,
                                                  greedy(n=n, max_tokens=max_tokens))):
                last = out
            return last

        async def cancelled_after_first(request_id: str) -> None:
            stream = aengine.add(imported(request_id, first, kv, greedy(n=n, max_tokens=long)))
            async for _ in stream:
                break
            await stream.aclose()

        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.gather(
                consume("deadline-0", long), consume("deadline-1", long)), timeout=0.3)
        ok, _ = await asyncio.gather(consume("ok", MAX_TOKENS), cancelled_after_first("gone"))
        assert ok is not None and ok.finished
        assert sorted(len(c.token_ids) for c in ok.outputs) == [MAX_TOKENS] * n
        # A refused request leaves nothing either.
        with pytest.raises(KVCacheFullError):
            await consume("too-big", 10_000 // n)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            load = aengine.load()
            if load.num_free_blocks == load.num_total_blocks and not load.num_running \
                    and not load.num_waiting:
                break
            await asyncio.sleep(0.02)
        load = aengine.load()
        assert (load.num_free_blocks, load.num_running, load.num_waiting) == (
            load.num_total_blocks, 0, 0)
    finally:
        await aengine.shutdown()
    assert_clean(engine)
    with pytest.raises(EngineError):
        await aengine.abort("ok")
