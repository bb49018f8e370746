"""Admission: validation naming the field, capacity limits with retry hints, FIFO, deadlines."""

from __future__ import annotations

import asyncio

import pytest

from pdmesh.router.admission import (
    Admission,
    AdmissionLimits,
    DeadlineExpired,
    InvalidRequest,
    OverCapacity,
    budget_tokens,
    sampling_from_proto,
    validate_prompt,
)
from pdmesh.v1 import common_pb2

pytestmark = [pytest.mark.anyio, pytest.mark.fast]


@pytest.fixture(name="anyio_backend")
def anyio_backend_fixture() -> str:
    return "asyncio"


async def test_admits_within_limits_and_releases() -> None:
    admission = Admission(AdmissionLimits(max_concurrent_requests=2, max_inflight_tokens=100))
    a = await admission.acquire(40)
    b = await admission.acquire(60)
    assert (admission.running, admission.inflight_tokens) == (2, 100)
    a.release()
    a.release()  # idempotent
    b.release()
    assert (admission.running, admission.inflight_tokens) == (0, 0)


async def test_full_queue_is_resource_exhausted_with_a_hint() -> None:
    limits = AdmissionLimits(max_concurrent_requests=1, max_queued_requests=0, retry_after_s=0.5)
    admission = Admission(limits)
    ticket = await admission.acquire(10)
    with pytest.raises(OverCapacity, match="capacity") as info:
        await admission.acquire(10)
    assert info.value.retry_after_s >= 0.5
    ticket.release()
    (await admission.acquire(10)).release()


async def test_token_budget_limits_concurrency() -> None:
    admission = Admission(AdmissionLimits(max_inflight_tokens=100, max_queued_requests=0))
    ticket = await admission.acquire(80)
    with pytest.raises(OverCapacity):
        await admission.acquire(30)
    small = await admission.acquire(20)
    ticket.release()
    small.release()


async def test_request_larger_than_the_whole_budget_is_invalid() -> None:
    admission = Admission(AdmissionLimits(max_inflight_tokens=100))
    with pytest.raises(InvalidRequest) as info:
        await admission.acquire(101)
    assert info.value.field == "sampling.max_tokens"


async def test_waiters_are_admitted_in_fifo_order() -> None:
    admission = Admission(AdmissionLimits(max_concurrent_requests=1, max_queued_requests=4))
    first = await admission.acquire(1)
    order: list[int] = []

    async def waiter(i: int) -> None:
        ticket = await admission.acquire(1)
        order.append(i)
        ticket.release()

    tasks = []
    for i in range(3):
        tasks.append(asyncio.create_task(waiter(i)))
        while admission.queued < i + 1:  # bounded: each task enqueues on its first step
            await asyncio.sleep(0)
    first.release()
    async with asyncio.timeout(5):
        await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert (admission.running, admission.queued) == (0, 0)


async def test_deadline_while_queued_and_queue_wait_limit() -> None:
    limits = AdmissionLimits(max_concurrent_requests=1, max_queue_wait_s=0.05)
    admission = Admission(limits)
    ticket = await admission.acquire(1)
    with pytest.raises(DeadlineExpired):
        await admission.acquire(1, timeout_s=0.01)
    with pytest.raises(OverCapacity, match="waited"):
        await admission.acquire(1, timeout_s=10.0)
    assert admission.queued == 0
    ticket.release()
    assert admission.running == 0


async def test_cancelled_waiter_leaves_no_trace() -> None:
    admission = Admission(AdmissionLimits(max_concurrent_requests=1))
    ticket = await admission.acquire(5)
    task = asyncio.create_task(admission.acquire(5))
    while admission.queued < 1:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    ticket.release()
    assert (admission.running, admission.inflight_tokens, admission.queued) == (0, 0, 0)


def test_sampling_defaults_follow_the_proto_comments() -> None:
    params = sampling_from_proto(common_pb2.SamplingParams())
    assert params.n == 1
    assert params.temperature == 1.0
    assert params.max_tokens is None
    assert params.logprobs is None
    assert params.skip_special_tokens is True
    greedy = sampling_from_proto(common_pb2.SamplingParams(temperature=0.0, max_tokens=5))
    assert greedy.is_greedy and greedy.max_tokens == 5


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"temperature": -1.0}, "sampling.temperature"),
        ({"max_tokens": 0}, "sampling.max_tokens"),
        ({"logprobs": 50}, "sampling.logprobs"),
        ({"presence_penalty": 3.0}, "sampling.presence_penalty"),
        ({"logit_bias": {1: 500.0}}, "sampling.logit_bias"),
    ],
)
def test_invalid_sampling_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        sampling_from_proto(common_pb2.SamplingParams(**kwargs))
    assert info.value.field == field
    assert field.split(".")[1] in str(info.value)


def test_validate_prompt_resolves_max_tokens_and_names_fields() -> None:
    params = sampling_from_proto(common_pb2.SamplingParams())
    assert validate_prompt([1, 2, 3], params, vocab_size=10, max_model_len=8) == 5
    bounded = sampling_from_proto(common_pb2.SamplingParams(max_tokens=6))
    cases = [
        ([], params, "prompt"),
        ([1, 99], params, "prompt.token_ids"),
        (list(range(8)), params, "prompt"),
        ([1, 2, 3], bounded, "sampling.max_tokens"),
        ([1, 2, 3], sampling_from_proto(common_pb2.SamplingParams(min_tokens=6)),
         "sampling.min_tokens"),
        ([1], sampling_from_proto(common_pb2.SamplingParams(stop_token_ids=[10])),
         "sampling.stop_token_ids"),
    ]
    for ids, p, field in cases:
        with pytest.raises(InvalidRequest) as info:
            validate_prompt(ids, p, vocab_size=10, max_model_len=8)
        assert info.value.field == field, (ids, str(info.value))


def test_budget_counts_every_sequence() -> None:
    assert budget_tokens(100, 10, 1, None) == 110
    assert budget_tokens(100, 10, 4, None) == 140
    # With the instances' block size: whole blocks, the prompt's full ones shared (the one
    # footprint of engine/request_rules.py, which the engines' capacity check uses too).
    assert budget_tokens(1000, 100, 4, 16) == 90 * 16
