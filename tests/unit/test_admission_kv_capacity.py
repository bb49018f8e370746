"""The KV-capacity rule shared by the router's admission and the engine: n samples, each run to
max_tokens, with the prompt's full blocks shared (as the engine forks them)."""

from __future__ import annotations

import pytest

from pdmesh.engine.request_rules import request_kv_blocks
from pdmesh.router.admission import ExceedsKVCapacity, check_kv_capacity

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "n", "blocks"),
    [
        (20, 6, 1, 2),  # one full prompt block + the partial one
        (20, 6, 4, 1 + 4 * 1),  # the full block shared, each sample its own partial copy
        (32, 1, 3, 2 + 3 * 1),  # block-aligned prompt: each sample's first output block
        (20, 28, 3, 1 + 3 * 2),
        (5, 100, 2, 2 * 7),  # no full prompt block to share
    ],
)
def test_request_kv_blocks(prompt: int, max_tokens: int, n: int, blocks: int) -> None:
    assert request_kv_blocks(prompt, max_tokens, n, 16) == blocks


def test_a_request_that_fits_passes() -> None:
    check_kv_capacity(20, 6, 10, block_size=16, capacity_tokens=11 * 16)


def test_a_request_that_can_never_fit_is_refused_with_the_figures() -> None:
    with pytest.raises(ExceedsKVCapacity) as err:
        check_kv_capacity(20, 6, 11, block_size=16, capacity_tokens=11 * 16 + 15)
    message = str(err.value)
    assert "12 KV blocks" in message and "n=11" in message and "11 blocks" in message
    assert "lower n or max_tokens" in message
