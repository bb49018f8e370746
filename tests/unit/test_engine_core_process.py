"""The engine core in its own process: same tokens as in-process, KV across the boundary,
aborts free blocks, a dead core fails everything at once; and the wire format refuses junk."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest
import torch

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core_protocol import (
    CALL_DECODER,
    ENCODER,
    Add,
    Call,
    TensorHeader,
    tensor_from_frame,
    tensor_to_frame,
)
from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.frontend.async_engine import AsyncEngine, EngineError
from pdmesh.engine.frontend.llm_engine import LLMEngine
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.structured_output import StructuredOutput
from pdmesh.engine.worker.cpu_threads import SHORT_SPIN, core_threads, usable_cpus
from tests.engine_steps import collect, reference, wait_all_free

PROMPT = "The three primary colors are"
CONFIG = EngineConfig(model="smollm2", kv_cache_memory="64MiB", max_model_len=512)


# -- the wire format (fast) ---------------------------------------------------------------------
@pytest.mark.fast
def test_sampling_params_cross_the_wire_validated() -> None:
    params = SamplingParams(n=2, temperature=0.7, seed=5, stop=["x"], logit_bias={3: 1.5},
                            structured_output=StructuredOutput(choice=("a", "b")))
    call = CALL_DECODER.decode(ENCODER.encode(Call(7, Add("r", [1, 2], params))))
    assert call.call_id == 7 and call.command.params == params
    bad = ENCODER.encode(Call(1, Add("r", [1], SamplingParams()))).replace(
        b"\xa4seed\xc0", b"\xa4seed\xa1x")  # seed: a string
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):
        CALL_DECODER.decode(bad)


@pytest.mark.fast
def test_an_add_carries_the_whole_engine_request_but_its_kv() -> None:
    kv = torch.zeros(1)
    request = EngineRequest("r", [1, 2], SamplingParams(n=2), priority=3, cache_salt="s",
                            kv=kv, given_tokens=[[5], [6]], num_cached_tokens=16)
    wire = {f.name for f in dataclasses.fields(EngineRequest)} - {"kv"}
    assert set(Add.__struct_fields__) == wire
    call = CALL_DECODER.decode(ENCODER.encode(Call(1, Add.of(request))))
    assert call.command.request(kv) == request


@pytest.mark.fast
def test_tensor_frames_round_trip_and_refuse_mismatches() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(2, 3, 4).to(dtype)
        header, data = tensor_to_frame(t)
        assert torch.equal(tensor_from_frame(header, bytes(data)), t)
    with pytest.raises(ValueError, match="needs"):
        tensor_from_frame(TensorHeader([2, 2], "float32"), b"\0" * 12)
    with pytest.raises(ValueError, match="dtype"):
        tensor_from_frame(TensorHeader([1], "int64"), b"\0" * 8)
    with pytest.raises(ValueError, match="negative"):
        tensor_from_frame(TensorHeader([-1], "float32"), b"")


# -- a real core process (slow) -----------------------------------------------------------------
@pytest.fixture(name="llm_engine", scope="module")
def llm_engine_fixture() -> Iterator[LLMEngine]:
    yield LLMEngine(CONFIG)


@pytest.fixture(name="proc_engine")
async def proc_engine_fixture() -> AsyncIterator[AsyncEngine]:
    engine = await AsyncEngine.spawn(CONFIG)
    yield engine
    await engine.shutdown()


slow = pytest.mark.slow


@pytest.mark.weights
@pytest.mark.processes
@slow
@pytest.mark.anyio
async def test_process_core_matches_in_process(llm_engine: LLMEngine,
                                               proc_engine: AsyncEngine) -> None:
    assert proc_engine.core_pid is not None and proc_engine.core_pid != os.getpid()
    auto = core_threads(None, CONFIG.torch_device().type, usable_cpus())
    assert proc_engine.info.torch_threads == (auto or int(os.environ["OMP_NUM_THREADS"]))
    with open(f"/proc/{proc_engine.core_pid}/environ", "rb") as f:
        core_env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    assert core_env[b"GOMP_SPINCOUNT"] == os.environ.get("GOMP_SPINCOUNT", SHORT_SPIN).encode()
    cases = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, seed=11, n=2, max_tokens=16, stop=[" and"],
                       prompt_logprobs=1),
    ]
    for params in cases:
        want = reference(llm_engine, PROMPT, params)
        outs = await collect(proc_engine.generate("p", PROMPT, params))
        got = outs[-1]
        assert got.finished and len(outs) > 1  # streamed, not one blob
        for mine, theirs in zip(got.outputs, want.outputs, strict=True):
            assert (mine.token_ids, mine.text, mine.finish_reason, mine.stop_reason) == (
                theirs.token_ids, theirs.text, theirs.finish_reason, theirs.stop_reason)
            assert mine.logprobs == theirs.logprobs
        assert got.prompt_logprobs == want.prompt_logprobs
    await wait_all_free(proc_engine)


@pytest.mark.weights
@pytest.mark.processes
@slow
@pytest.mark.anyio
async def test_kv_export_import_across_the_boundary(llm_engine: LLMEngine,
                                                    proc_engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = reference(llm_engine, PROMPT, params)
    first = await proc_engine.prefill_export("x", PROMPT, params)
    kv = await proc_engine.read_kv("x")
    assert kv.shape[2] == len(first.kv_export.block_ids)  # type: ignore[union-attr]
    assert await proc_engine.release_kv("x")
    outs = await collect(proc_engine.add(EngineRequest(
        "y", first.prompt_token_ids, params, kv=kv,
        given_tokens=[[first.outputs[0].token_ids[0]]])))
    assert outs[-1].outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValueError, match="kv: shape"):
        await collect(proc_engine.add(EngineRequest(
            "z", first.prompt_token_ids, params, kv=kv[:, :1], given_tokens=[[1]])))
    await wait_all_free(proc_engine)


@pytest.mark.weights
@pytest.mark.processes
@slow
@pytest.mark.anyio
async def test_abort_and_errors_across_the_boundary(proc_engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="prompt"):
        await collect(proc_engine.generate("bad", {"prompt_token_ids": []}, SamplingParams()))
    stream = proc_engine.generate("ab", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
    await stream.__anext__()
    assert await proc_engine.abort("ab")
    with pytest.raises(EngineError, match="aborted"):
        await collect(stream)
    leaving = proc_engine.generate("lv", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
    await leaving.__anext__()
    await leaving.aclose()  # the consumer walks away: its blocks come back
    await wait_all_free(proc_engine)


@pytest.mark.weights
@pytest.mark.processes
@slow
@pytest.mark.anyio
async def test_dead_core_fails_everything_at_once() -> None:
    engine = await AsyncEngine.spawn(CONFIG)
    try:
        stream = engine.generate("d", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        assert engine.core_pid is not None
        os.kill(engine.core_pid, signal.SIGKILL)
        with pytest.raises(EngineError, match="exited"):
            await asyncio.wait_for(collect(stream), 10.0)
        await asyncio.wait_for(engine.dead_event.wait(), 10.0)
        with pytest.raises(EngineError):
            await asyncio.wait_for(collect(engine.generate("e", PROMPT, SamplingParams())), 10.0)
    finally:
        await engine.shutdown()


@pytest.fixture(name="anyio_backend")
def anyio_backend_fixture() -> str:
    return "asyncio"
