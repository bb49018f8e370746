"""A tensor-parallel rank's death fails its engine cleanly and leaves no process behind: in
the engine core's own process (the serving path) the core exits, so its streams fail (and the
router migrates them, as for any dead core); in an offline `LLM` the step raises."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import psutil
import pytest

from pdmesh import LLM, SamplingParams
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.frontend.async_engine import AsyncEngine, EngineError

pytestmark = [pytest.mark.slow, pytest.mark.weights, pytest.mark.processes]

RANK_MODULE = "pdmesh.engine.core.rank_process"


def rank_processes(parent: psutil.Process) -> list[psutil.Process]:
    return [p for p in parent.children(recursive=True)
            if RANK_MODULE in " ".join(p.cmdline())]


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.anyio
async def test_a_killed_rank_ends_the_engine_core_and_fails_its_streams() -> None:
    config = EngineConfig(model="smollm2", kv_cache_memory="64MiB", max_model_len=512,
                          tensor_parallel_size=2, cpu_threads=2)
    engine = await AsyncEngine.spawn(config)
    try:
        assert engine.core_pid is not None
        core = psutil.Process(engine.core_pid)
        (rank,) = rank_processes(core)
        stream = engine.generate("r", "Hello", SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        os.kill(rank.pid, signal.SIGKILL)
        await asyncio.wait_for(engine.dead_event.wait(), 60.0)
        assert engine.dead_reason == "engine core process exited with code 1"
        with pytest.raises(EngineError):
            async for _ in stream:
                pass
    finally:
        await engine.shutdown()
    assert gone(rank) and gone(core)


def test_a_killed_rank_fails_the_offline_engines_step_and_close_leaves_nothing() -> None:
    llm = LLM("smollm2", kv_cache_memory="64MiB", max_model_len=512, tensor_parallel_size=2)
    me = psutil.Process()
    try:
        (rank,) = rank_processes(me)
        greedy = SamplingParams(temperature=0.0, max_tokens=4)
        assert llm.generate("Hi", greedy)[0].outputs[0].token_ids
        rank.kill()
        rank.wait(30)
        with pytest.raises(RuntimeError):
            llm.generate("Hi", greedy)
    finally:
        llm.engine.core.close()
    assert llm.engine.core.ranks is None
    assert not rank_processes(me)


def test_close_stops_the_ranks() -> None:
    llm = LLM("smollm2", kv_cache_memory="64MiB", max_model_len=512, tensor_parallel_size=2)
    me = psutil.Process()
    assert len(rank_processes(me)) == 1
    ranks = llm.engine.core.ranks
    assert ranks is not None
    llm.engine.core.close()
    assert [p.process.returncode for p in ranks.procs] == [0]  # it left when told to
    assert not rank_processes(me)


@pytest.fixture(name="anyio_backend")
def anyio_backend_fixture() -> str:
    return "asyncio"


def test_an_engine_built_on_another_thread_keeps_its_ranks_after_that_thread_ends() -> None:
    """PR_SET_PDEATHSIG follows the thread that started a process: ranks started from a thread
    that then ends (`asyncio.to_thread`, an in-process serving core) must not die with it."""
    built: list[LLM] = []
    thread = threading.Thread(target=lambda: built.append(
        LLM("smollm2", kv_cache_memory="64MiB", max_model_len=512, tensor_parallel_size=2)))
    thread.start()
    thread.join()
    (llm,) = built
    try:
        out = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=4))[0]
        assert len(out.outputs[0].token_ids) == 4
        assert llm.engine.core.ranks is not None and llm.engine.core.ranks.dead is None
    finally:
        llm.engine.core.close()


def test_a_step_failing_on_rank_zero_ends_the_ranks_instead_of_leaving_them_waiting() -> None:
    llm = LLM("smollm2", kv_cache_memory="64MiB", max_model_len=512, tensor_parallel_size=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    ranks = llm.engine.core.ranks
    assert ranks is not None
    model = llm.engine.runner.model

    def broken_head(hidden):  # type: ignore[no-untyped-def]
        raise MemoryError("out of memory in the LM head")  # rank 1 waits in the gather

    model.compute_logits = broken_head
    try:
        with pytest.raises(MemoryError):
            llm.generate("Hi", greedy)
        assert all(p.process.returncode is not None for p in ranks.procs)  # ended, not waiting
        with pytest.raises(RuntimeError, match="out of step"):
            llm.generate("Hi", greedy)
    finally:
        llm.engine.core.close()
    assert not rank_processes(psutil.Process())
