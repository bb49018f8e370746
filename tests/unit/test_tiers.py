"""The test tiers' rule (tests/tiers.py): what makes tests/conftest.py fail a test."""

from __future__ import annotations

import pytest

from tests.tiers import tier_problem

pytestmark = pytest.mark.fast


def test_a_test_must_name_a_tier() -> None:
    assert "names no tier" in str(tier_problem("t", {"parametrize", "anyio"}, set()))
    for marks in ({"fast"}, {"weights"}, {"redis", "slow"}, {"e2e"}, {"slow"}):
        assert tier_problem("t", marks, {"tmp_path"}) is None


def test_a_fast_test_may_not_need_weights_redis_or_processes() -> None:
    assert "needs processes" in str(tier_problem("t", {"fast", "processes"}, set()))
    assert "needs hf_tokenizer (weights)" in str(tier_problem("t", {"fast"}, {"hf_tokenizer"}))
    assert "needs conn (redis)" in str(tier_problem("t", {"fast"}, {"conn", "keyspace"}))
    assert tier_problem("t", {"weights"}, {"model_dir"}) is None
