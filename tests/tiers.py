"""The test tiers' rule (tests/conftest.py applies it to every test before it runs)."""

from __future__ import annotations

TIERS = ("fast", "weights", "redis", "processes", "slow", "e2e")
"""The markers that say what a test needs; every test has at least one."""

HEAVY_FIXTURES = {
    "model_dir": "weights", "hf_model": "weights", "hf_tokenizer": "weights",  # conftest.py
    "redis_server": "redis", "conn": "redis", "raw": "redis",  # tests/redis_fixture.py
}
"""Fixtures a fast test may not use (directly or through its own fixtures), and their tier."""


def tier_problem(nodeid: str, marks: set[str], fixtures: set[str]) -> str | None:
    """Why the test `nodeid` with these markers and fixtures breaks the rule, or None."""
    tiers = marks.intersection(TIERS)
    if not tiers:
        return (f"{nodeid} names no tier: give its module `pytestmark = pytest.mark.fast` or "
                f"what it needs ({', '.join(TIERS[1:])}); see tests/conftest.py")
    heavy = sorted(f"{name} ({HEAVY_FIXTURES[name]})" for name in fixtures & HEAVY_FIXTURES.keys())
    if "fast" in tiers and (len(tiers) > 1 or heavy):
        why = ", ".join([*sorted(tiers - {"fast"}), *heavy])
        return f"{nodeid} is marked fast but needs {why}: mark it with what it needs instead"
    return None
