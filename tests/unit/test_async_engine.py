"""AsyncEngine against a real LLMEngine (SmolLM2): streams, export/import, cancel, errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.frontend.async_engine import AsyncEngine, EngineError
from pdmesh.engine.frontend.llm_engine import LLMEngine
from pdmesh.engine.frontend.request_streams import RequestStream
from pdmesh.engine.kv_events import AllBlocksCleared, BlockStored
from pdmesh.engine.outputs import RequestOutput
from pdmesh.engine.sampling_params import SamplingParams
from tests.engine_steps import collect, reference, wait_all_free

pytestmark = [pytest.mark.slow, pytest.mark.weights]

PROMPT = "The three primary colors are"


@pytest.fixture(name="llm_engine", scope="module")
def llm_engine_fixture() -> Iterator[LLMEngine]:
    yield LLMEngine(EngineConfig(model="smollm2", kv_cache_memory="64MiB", max_model_len=512))


@pytest.fixture(name="aengine")
async def aengine_fixture(llm_engine: LLMEngine) -> AsyncIterator[AsyncEngine]:
    engine = AsyncEngine(llm_engine)
    yield engine
    await engine.shutdown()
    for request_id in list(llm_engine.requests):  # leave the shared engine clean
        llm_engine.abort_request(request_id)


@pytest.fixture(name="greedy_ref", scope="module")
def greedy_ref_fixture(llm_engine: LLMEngine) -> RequestOutput:
    return reference(llm_engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=12))


@pytest.fixture(name="seeded_ref", scope="module")
def seeded_ref_fixture(llm_engine: LLMEngine) -> RequestOutput:
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, n=2)
    return reference(llm_engine, PROMPT, params)


@pytest.mark.anyio
async def test_generate_streams_to_the_same_tokens(
    aengine: AsyncEngine, greedy_ref: RequestOutput
) -> None:
    outs = await collect(
        aengine.generate("g1", PROMPT, SamplingParams(temperature=0.0, max_tokens=12))
    )
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[-1].outputs[0].token_ids == greedy_ref.outputs[0].token_ids
    assert len(outs) > 1  # streamed, not one final blob
    await wait_all_free(aengine)


@pytest.mark.anyio
async def test_a_consumer_that_falls_behind_gets_the_newest_output(
    aengine: AsyncEngine, greedy_ref: RequestOutput
) -> None:
    """Outputs are cumulative: one that fell behind is handed the latest at once, not a
    backlog of every step's (its gRPC stream then sends one message with several tokens)."""
    stream = aengine.generate("slow", PROMPT, SamplingParams(temperature=0.0, max_tokens=12))
    first = await anext(stream)
    assert not first.finished
    await wait_all_free(aengine)  # the core finished the request meanwhile
    rest = [out async for out in stream]
    assert len(rest) == 1 and rest[0].finished
    assert rest[0].outputs[0].token_ids == greedy_ref.outputs[0].token_ids


@pytest.mark.anyio
async def test_an_error_comes_after_the_output_pending_before_it(
    greedy_ref: RequestOutput
) -> None:
    stream = RequestStream("r")
    stream.put(greedy_ref)
    stream.fail(EngineError("core died"))
    assert await stream.next() is greedy_ref
    with pytest.raises(EngineError, match="core died"):
        await stream.next()


@pytest.mark.anyio
async def test_concurrent_streams(aengine: AsyncEngine, greedy_ref: RequestOutput) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    results = await asyncio.gather(
        *(collect(aengine.generate(f"c{i}", PROMPT, params)) for i in range(3))
    )
    for outs in results:
        assert outs[-1].outputs[0].token_ids == greedy_ref.outputs[0].token_ids


@pytest.mark.anyio
async def test_export_import_matches_colocated_seeded(
    aengine: AsyncEngine, seeded_ref: RequestOutput
) -> None:
    """Seeded sampling continues the random stream after the prefill's draw."""
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, n=2)
    exported = await aengine.prefill_export("p1", PROMPT, params)
    assert exported.kv_export is not None
    assert aengine.load().num_pinned_blocks == len(exported.kv_export.block_ids)
    kv = await aengine.read_kv("p1")
    assert await aengine.release_kv("p1")
    assert aengine.load().num_pinned_blocks == 0
    first = [c.token_ids[0] for c in sorted(exported.outputs, key=lambda c: c.index)]
    outs = await collect(aengine.add(EngineRequest(
        "d1", list(exported.prompt_token_ids), params, kv=kv, given_tokens=[[t] for t in first]
    )))
    got = {c.index: c.token_ids for c in outs[-1].outputs}
    want = {c.index: c.token_ids for c in seeded_ref.outputs}
    assert got == want
    await wait_all_free(aengine)


@pytest.mark.anyio
async def test_consumer_leaving_aborts_and_frees(aengine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    stream = aengine.generate("cancel-me", PROMPT, params)
    seen = 0
    async for out in stream:
        seen += 1
        assert not out.finished
        if seen == 3:
            break
    await stream.aclose()
    await wait_all_free(aengine)
    assert "cancel-me" not in aengine.engine.requests


@pytest.mark.anyio
async def test_cancelled_task_aborts(aengine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in aengine.generate("task-cancel", PROMPT, params):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_all_free(aengine)


@pytest.mark.anyio
async def test_invalid_request_raises_before_output(aengine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="prompt"):
        await collect(aengine.generate("bad", {"prompt_token_ids": []}, SamplingParams()))
    with pytest.raises(ValueError, match="already running"):
        first = aengine.generate("dup", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
        await first.__anext__()
        await collect(aengine.generate("dup", PROMPT, SamplingParams()))
    await first.aclose()
    await wait_all_free(aengine)


@pytest.mark.anyio
async def test_abort_fails_the_stream(aengine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    stream = aengine.generate("ab", PROMPT, params)
    await stream.__anext__()
    assert await aengine.abort("ab")
    with pytest.raises(EngineError, match="aborted"):
        await collect(stream)
    assert not await aengine.abort("ab")
    await wait_all_free(aengine)


@pytest.mark.anyio
async def test_kv_events_and_snapshot(aengine: AsyncEngine) -> None:
    await aengine.take_kv_events()
    await collect(aengine.generate("ev", PROMPT * 8, SamplingParams(max_tokens=2)))
    events = await aengine.take_kv_events()
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored and aengine.kv_events_ready.is_set()
    snapshot = await aengine.kv_snapshot()
    assert isinstance(snapshot[0], AllBlocksCleared)
    assert set(stored) <= set(snapshot[1].block_hashes)  # type: ignore[union-attr]


@pytest.mark.anyio
async def test_shutdown_fails_pending_streams(llm_engine: LLMEngine) -> None:
    engine = AsyncEngine(llm_engine)
    stream = engine.generate("sd", PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
    await stream.__anext__()
    await engine.shutdown()
    with pytest.raises(EngineError):
        await collect(stream)
    with pytest.raises(EngineError):
        await engine.abort("sd")
    assert not llm_engine.requests


@pytest.fixture(name="anyio_backend")
def anyio_backend_fixture() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_a_failure_handling_outputs_fails_streams_instead_of_hanging(
        llm_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = AsyncEngine(llm_engine)
    try:
        def broken(outputs: object) -> object:
            raise RuntimeError("bug in the output processor")

        monkeypatch.setattr(engine.processor, "process", broken)
        with pytest.raises(EngineError, match="output handling failed"):
            await asyncio.wait_for(
                collect(engine.generate("oops", PROMPT, SamplingParams(max_tokens=4))), 10.0)
        assert engine.dead_event.is_set()
    finally:
        await asyncio.wait_for(engine.shutdown(), 30.0)  # the core still lives: told to stop
    assert not llm_engine.requests
