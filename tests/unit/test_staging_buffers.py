"""Staging buffers kept between staged pulls (kvstore/connector/staging_buffers.py): a pull
reuses a free buffer that holds it (not one more than twice its size), a buffer in use is never
handed out twice, and no more than the limit is kept."""

from __future__ import annotations

import pytest
import torch

from pdmesh.kvstore.connector.staging_buffers import ROUND_BYTES, StagingBuffers

pytestmark = pytest.mark.fast

CPU = torch.device("cpu")


def test_a_returned_buffer_is_reused_for_a_pull_it_holds() -> None:
    pool = StagingBuffers(64 << 20)
    a = pool.take((30, 2, 64, 16, 3, 64), torch.float32, CPU)
    assert a.is_contiguous() and a.shape == (30, 2, 64, 16, 3, 64)
    b = pool.take((30, 2, 64, 16, 3, 64), torch.float32, CPU)
    assert b.data_ptr() != a.data_ptr()  # a is in use: never handed out twice
    pool.give_back(a)
    c = pool.take((30, 2, 60, 16, 3, 64), torch.float32, CPU)  # a little smaller: fits
    assert c.data_ptr() == a.data_ptr()
    pool.give_back(c)
    tiny = pool.take((1, 2, 1, 16, 3, 64), torch.float32, CPU)  # far smaller: not that one
    assert tiny.data_ptr() != a.data_ptr()
    pool.give_back(tiny)  # two of different sizes kept: each pull gets its own back
    pool.give_back(b)
    assert pool.take((30, 2, 64, 16, 3, 64), torch.float32, CPU).data_ptr() in (
        a.data_ptr(), b.data_ptr())
    assert pool.take((1, 2, 1, 16, 3, 64), torch.float32, CPU).data_ptr() == tiny.data_ptr()


def test_at_most_the_limit_is_kept_and_a_buffer_is_kept_once() -> None:
    pool = StagingBuffers(3 * ROUND_BYTES)
    buffers = [pool.take((ROUND_BYTES // 4,), torch.float32, CPU) for _ in range(4)]
    for b in buffers:
        pool.give_back(b)
    assert pool.kept_bytes == 3 * ROUND_BYTES
    pool.give_back(buffers[0])  # twice: still once
    assert pool.kept_bytes == 3 * ROUND_BYTES
    pool.give_back(torch.zeros(8))  # not one of ours
    assert pool.kept_bytes == 3 * ROUND_BYTES and pool.in_use == 0


def test_a_dropped_buffer_is_never_handed_out_again() -> None:
    pool = StagingBuffers(8 << 20)
    a = pool.take((1024,), torch.float32, CPU)
    pool.drop(a)  # a transfer may still write it
    pool.give_back(a)  # too late: not ours any more
    assert pool.kept_bytes == 0 and pool.in_use == 0
    assert pool.take((1024,), torch.float32, CPU).data_ptr() != a.data_ptr()


def test_views_of_a_buffer_have_the_pulls_dtype() -> None:
    pool = StagingBuffers(8 << 20)
    half = pool.take((4, 5), torch.float16, CPU)
    assert half.dtype == torch.float16 and half.shape == (4, 5)
    pool.give_back(half)
    again = pool.take((2, 3), torch.bfloat16, CPU)
    assert again.data_ptr() == half.data_ptr() and again.dtype == torch.bfloat16
