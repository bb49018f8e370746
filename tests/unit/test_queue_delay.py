"""Admission by predicted wait (router/queue_delay.py): the prediction from the router's own
backlog and the instances' measured rates, and when it refuses."""

from __future__ import annotations

import pytest

from pdmesh.router.admission import OverCapacity
from pdmesh.router.queue_delay import RATE_WINDOW_S, QueueDelay, Worker

pytestmark = pytest.mark.fast


def worker(name: str, tokens: int, seconds: float, *, prefills: bool = True,
           healthy: bool = True) -> Worker:
    return Worker(name, prefills, healthy, tokens, seconds)


def test_the_rate_is_each_instance_s_best_recent_interval_summed() -> None:
    delay = QueueDelay(max_delay_s=5)
    delay.observe([worker("a", 0, 0.0), worker("b", 0, 0.0)], now=0)
    # a: 1,000 tok/s while prefilling, then 100 tok/s decoding; b: 500 tok/s.
    delay.observe([worker("a", 1000, 1.0), worker("b", 500, 1.0)], now=1)
    delay.observe([worker("a", 1100, 2.0), worker("b", 1000, 2.0)], now=2)
    assert delay.rate([worker("a", 1100, 2.0), worker("b", 1000, 2.0)]) == pytest.approx(1500)
    # Intervals of too few tokens say nothing; samples older than the window are forgotten.
    delay.observe([worker("a", 1110, 3.0), worker("b", 1000, 2.0)], now=3)
    delay.observe([worker("a", 1210, 4.0), worker("b", 1100, 3.0)], now=3 + RATE_WINDOW_S)
    assert delay.rate([worker("a", 0, 0), worker("b", 0, 0)]) == pytest.approx(200)


def test_prefill_instances_do_the_prefill_and_unhealthy_ones_nothing() -> None:
    delay = QueueDelay(max_delay_s=5)
    fleet = [worker("p", 0, 0.0), worker("d", 0, 0.0, prefills=False)]
    delay.observe(fleet, now=0)
    fleet = [worker("p", 1000, 1.0), worker("d", 4000, 1.0, prefills=False)]
    delay.observe(fleet, now=1)
    assert delay.rate(fleet) == pytest.approx(1000)
    down = [worker("p", 1000, 1.0, healthy=False), worker("d", 4000, 1.0, prefills=False)]
    assert delay.rate(down) == pytest.approx(4000)  # decode instances prefill locally then


def test_refuses_past_the_bound_with_a_retry_hint_and_only_when_busy() -> None:
    delay = QueueDelay(max_delay_s=5)
    fleet = [worker("p", 0, 0.0)]
    delay.observe(fleet, now=0)
    fleet = [worker("p", 1000, 1.0)]
    delay.observe(fleet, now=1)  # 1,000 tokens/s
    delay.admit(20_000, fleet)  # alone: never refused for its own length
    delay.started(4000)
    delay.admit(1000, fleet)  # (4,000 + 1,000) / 1,000 = 5 s: at the bound
    with pytest.raises(OverCapacity, match=r"~7s .* over --max-queue-delay-s=5") as info:
        delay.admit(3000, fleet)
    assert info.value.reason == "predicted_delay"
    assert info.value.retry_after_s == pytest.approx(2.0)
    delay.first_token(4000)
    delay.admit(3000, fleet)
    assert delay.backlog_tokens == 0


def test_nothing_is_refused_before_a_rate_is_measured_or_when_off() -> None:
    fleet = [worker("p", 0, 0.0)]
    delay = QueueDelay(max_delay_s=1)
    delay.started(10**6)
    delay.admit(10**6, fleet)
    off = QueueDelay(max_delay_s=0)
    off.observe([worker("p", 0, 0.0)], now=0)
    off.observe([worker("p", 100, 1.0)], now=1)
    off.started(10**6)
    off.admit(10**6, [worker("p", 100, 1.0)])
