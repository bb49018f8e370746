"""Driving an `LLMEngine` by hand, and reading an `AsyncEngine`'s streams, in engine tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from pdmesh.engine.frontend.async_engine import AsyncEngine
from pdmesh.engine.frontend.llm_engine import LLMEngine
from pdmesh.engine.outputs import RequestOutput
from pdmesh.engine.sampling_params import SamplingParams


def run_to_finish(engine: LLMEngine, max_steps: int = 400) -> RequestOutput:
    """Step until the last request finishes; its final output. The engine must then hold no
    blocks (every test that drives it checks nothing leaks)."""
    final: RequestOutput | None = None
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                final = out
        if final is not None and not engine.has_unfinished_requests():
            assert engine.num_free_blocks == engine.num_total_blocks
            return final
    raise AssertionError(f"engine still busy after {max_steps} steps")


def reference(engine: LLMEngine, prompt: str, params: SamplingParams) -> RequestOutput:
    """The synchronous engine's own answer to one request (the reference for async paths)."""
    engine.add_request("ref", prompt, params)
    return run_to_finish(engine)


async def collect(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    """Every output an `AsyncEngine` stream yields."""
    return [out async for out in stream]


async def wait_all_free(engine: AsyncEngine, timeout_s: float = 10.0) -> None:
    """Until the engine's load shows every block free and nothing running (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        load = engine.load()
        if load.num_free_blocks == load.num_total_blocks and load.num_running == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"blocks not freed: {engine.load()}")
