"""Routing policies: the documented cost function, tie-breaking, and the baselines."""

from __future__ import annotations

import pytest

from pdmesh.router.routing import (
    Candidate,
    LoadSnapshot,
    NoCandidateError,
    RouteRequest,
    make_policy,
)
from pdmesh.router.routing.prefix_aware import PrefixAwarePolicy, prefix_cost

pytestmark = pytest.mark.fast


def load(free: int, total: int = 200, running: int = 0, inflight_blocks: int = 0) -> LoadSnapshot:
    return LoadSnapshot(
        num_running=running,
        num_free_blocks=free,
        num_total_blocks=total,
        inflight_blocks=inflight_blocks,
    )


def readme_example() -> tuple[RouteRequest, list[Candidate]]:
    """The worked example of router/routing/README.md."""
    request = RouteRequest(num_prompt_tokens=1000, block_size=16)
    candidates = [
        Candidate("P0", load(free=80), cached_blocks=50),  # 120 active
        Candidate("P1", load(free=160), cached_blocks=0),  # 40 active
        Candidate("P2", load(free=145), cached_blocks=20),  # 55 active
    ]
    return request, candidates


def test_readme_worked_example_costs_and_choice() -> None:
    request, candidates = readme_example()
    assert request.prompt_blocks == 63
    assert [prefix_cost(request, c, 1.0) for c in candidates] == [133, 103, 98]
    assert PrefixAwarePolicy(1.0).choose(request, candidates).instance_id == "P2"
    assert [prefix_cost(request, c, 2.0) for c in candidates] == [146, 166, 141]
    assert PrefixAwarePolicy(2.0).choose(request, candidates).instance_id == "P2"
    # "P0 would win as soon as its active blocks fell below 115".
    busy_p0 = Candidate("P0", load(free=86), cached_blocks=50)  # 114 active -> 140
    assert PrefixAwarePolicy(2.0).choose(request, [busy_p0, *candidates[1:]]).instance_id == "P0"


def test_prefix_aware_prefers_the_holder_when_loads_are_equal() -> None:
    request = RouteRequest(num_prompt_tokens=300, block_size=16)
    candidates = [Candidate("a", load(free=200)), Candidate("b", load(free=200), cached_blocks=18)]
    decision = make_policy("prefix_aware").choose(request, candidates)
    assert decision.instance_id == "b"
    assert decision.cached_blocks == 18


def test_prefix_aware_moves_off_an_overloaded_holder() -> None:
    request = RouteRequest(num_prompt_tokens=160, block_size=16)  # 10 blocks
    holder = Candidate("a", load(free=0, total=100), cached_blocks=10)  # cost 0 + 100
    idle = Candidate("b", load(free=100, total=100))  # cost 10 + 0
    assert make_policy("prefix_aware").choose(request, [holder, idle]).instance_id == "b"


def test_router_inflight_view_counts_when_polls_lag() -> None:
    request = RouteRequest(num_prompt_tokens=64, block_size=16)
    stale = Candidate("a", load(free=200, inflight_blocks=50))
    fresh = Candidate("b", load(free=190))
    assert make_policy("prefix_aware").choose(request, [stale, fresh]).instance_id == "b"


def test_cached_blocks_beyond_the_prompt_are_capped() -> None:
    request = RouteRequest(num_prompt_tokens=20, block_size=16)  # 2 blocks
    decision = make_policy("prefix_aware").choose(request, [Candidate("a", load(200), 9)])
    assert decision.cached_blocks == 2
    assert decision.cost == 0


def test_ties_break_on_longer_prefix_then_id() -> None:
    request = RouteRequest(num_prompt_tokens=64, block_size=16)
    policy = PrefixAwarePolicy(prefix_weight=0.0)
    same = [Candidate("b", load(200)), Candidate("a", load(200))]
    assert policy.choose(request, same).instance_id == "a"
    with_prefix = [Candidate("a", load(200)), Candidate("b", load(200), cached_blocks=1)]
    assert policy.choose(request, with_prefix).instance_id == "b"


def test_round_robin_ignores_prefix_and_cycles_by_id() -> None:
    request = RouteRequest(num_prompt_tokens=64, block_size=16)
    policy = make_policy("round_robin")
    candidates = [Candidate("c", load(200)), Candidate("a", load(200), 4), Candidate("b", load(9))]
    picks = [policy.choose(request, candidates).instance_id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_uses_requests_then_blocks() -> None:
    request = RouteRequest(num_prompt_tokens=64, block_size=16)
    policy = make_policy("least_loaded")
    candidates = [
        Candidate("a", load(free=100, running=2), cached_blocks=4),
        Candidate("b", load(free=50, running=1)),
        Candidate("c", load(free=150, running=1)),
    ]
    assert policy.choose(request, candidates).instance_id == "c"


@pytest.mark.parametrize("name", ["prefix_aware", "round_robin", "least_loaded"])
def test_no_candidates_is_an_error(name: str) -> None:
    with pytest.raises(NoCandidateError):
        make_policy(name).choose(RouteRequest(10, 16), [])


def test_unknown_policy_and_bad_weight_are_refused() -> None:
    with pytest.raises(ValueError, match="routing_policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="prefix_weight"):
        PrefixAwarePolicy(prefix_weight=-1)


def test_finished_requests_are_freed_in_a_stale_polled_load() -> None:
    from pdmesh.router.instances import Instance
    from pdmesh.v1 import engine_pb2

    def polled(free: int) -> engine_pb2.EngineLoad:
        return engine_pb2.EngineLoad(num_free_blocks=free, num_total_blocks=100, num_running=1)

    holder = Instance(address="127.0.0.1:1", role="prefill", channel=None)  # type: ignore[arg-type]
    started = holder.request_started(13)
    holder.apply_poll(polled(87), sent_at=started + 1e-6)  # taken while the request ran
    holder.request_finished(13, started)
    assert holder.snapshot().active_blocks == 0
    assert holder.snapshot().num_running == 0
    # An answer to a poll sent before the request finished still counts it: corrected again.
    holder.recent_finishes.clear()
    started = holder.request_started(13)
    holder.request_finished(13, started)
    finished = holder.recent_finishes[-1][1]
    holder.apply_poll(polled(87), sent_at=(started + finished) / 2)
    assert holder.snapshot().active_blocks == 0
    # A poll sent after the request finished is the truth and is kept as it is.
    holder.apply_poll(polled(90), sent_at=finished + 1.0)
    assert holder.snapshot().active_blocks == 10
