"""The stall bound and step-time estimate (engine/frontend/stall.py), and the engine service's
watchdog
over a real core process: stopped (SIGSTOP) with a request in flight it is judged stalled
after the bound, and serving again as soon as it is continued; a core that is merely idle, or
answering probes, never is."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.frontend.async_engine import AsyncEngine
from pdmesh.engine.frontend.stall import StallBound, StepTimes
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine_svc.watchdog import CoreWatchdog

CONFIG = EngineConfig(model="smollm2", kv_cache_memory="64MiB", max_model_len=512,
                      max_num_batched_tokens=64)
BOUND = StallBound(min_s=2.0, max_s=4.0, step_multiple=2.0)


@pytest.mark.fast
def test_bound_scales_with_the_longest_step_between_the_clamps() -> None:
    assert BOUND.seconds(None) == BOUND.seconds(0.0) == 4.0  # unknown: the upper clamp
    assert BOUND.seconds(0.01) == 2.0
    assert BOUND.seconds(1.5) == 3.0
    assert BOUND.seconds(60.0) == 4.0
    with pytest.raises(ValueError):
        StallBound(min_s=5.0, max_s=1.0)


@pytest.mark.fast
def test_longest_step_covers_a_full_budget_step_seen_only_in_small_ones() -> None:
    times = StepTimes()
    assert times.longest_step_s(2048) == 0.0
    times.observe(1, 0.05, 4)  # a decode step: 4 tokens in 50 ms
    times.observe(3, 0.11, 12)  # two more at 30 ms: their mean counts for each
    # A 2048-token step may cost up to 2048 x 7.5 ms at the cheapest rate seen so far.
    assert times.longest_step_s(2048) == pytest.approx(0.03 / 4 * 2048)
    times.observe(4, 1.11, 2060)  # a 2048-token prefill step took 1 s: the rate tightens
    assert times.longest_step_s(2048) == pytest.approx(1.0)
    times.observe(4, 1.11, 2060)  # no step since: nothing changes
    assert times.longest_step_s(2048) == pytest.approx(1.0)
    times.credible_s = 4.0
    times.observe(5, 21.11, 2064)  # 20 s for 4 tokens: the core was stopped mid-step
    assert times.longest_step_s(2048) == pytest.approx(1.0)


@pytest.fixture(name="engine")
async def engine_fixture() -> AsyncIterator[AsyncEngine]:
    engine = await AsyncEngine.spawn(CONFIG)
    yield engine
    await engine.shutdown()


async def judge_until(watchdog: CoreWatchdog, verdict: bool, timeout_s: float) -> float:
    """Run the watchdog's checks until it turns to `verdict` (serving?); seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if watchdog.check() == verdict:
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    raise AssertionError(f"the watchdog did not turn serving={verdict} in {timeout_s}s")


@pytest.mark.weights
@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.anyio
async def test_stopped_core_is_stalled_after_the_bound_and_serving_once_continued(
    engine: AsyncEngine,
) -> None:
    watchdog = CoreWatchdog(engine, BOUND, CONFIG.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    async for _ in engine.generate("warm", "The three primary colors are", params):
        pass
    assert watchdog.max_step_s() > 0 and not engine.liveness.busy
    for _ in range(10):  # idle: owes nothing, a probe is answered
        assert watchdog.check() is None
        await asyncio.sleep(0.05)
    assert engine.liveness.silent_s() == 0.0 and not watchdog.stalled

    pid = engine.core_pid
    assert pid is not None
    stream = engine.generate("hung", "Paris is the capital of",
                             SamplingParams(temperature=0.0, max_tokens=400))
    await anext(stream)  # it runs; now stop the core under it
    os.kill(pid, signal.SIGSTOP)
    try:
        # The service itself does not look for a while (as when it is stopped too): that time
        # is not held against the core.
        await asyncio.sleep(BOUND.max_s + 0.5)
        assert watchdog.check() is None and not watchdog.stalled
        await judge_until(watchdog, False, timeout_s=30)
        bound = watchdog.bound_s()
        assert watchdog.stalled and engine.liveness.busy
        assert engine.liveness.silent_s() >= bound
        await stream.aclose()  # the consumer leaves: the abort is owed too, still stalled
        for _ in range(5):
            assert watchdog.check() is None and watchdog.stalled
            await asyncio.sleep(0.05)
    finally:
        os.kill(pid, signal.SIGCONT)
    await judge_until(watchdog, True, timeout_s=10)
    assert not watchdog.stalled
