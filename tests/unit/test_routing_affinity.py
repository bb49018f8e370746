"""`prompt_cache_key` as routing affinity: a key keeps its instance while that instance is live
and not overloaded, under every policy, and the planner routes by the request's key."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from pdmesh.metrics import router_metrics
from pdmesh.router.instance import Instance
from pdmesh.router.pd_decider import PrefillDecider
from pdmesh.router.planner import Planner, decision_reason
from pdmesh.router.request import Lookup, PreparedRequest
from pdmesh.router.routing import Candidate, LoadSnapshot, RouteRequest, make_policy
from pdmesh.router.routing.base import (
    AFFINITY_MAX_EXTRA_REQUESTS,
    affinity_candidate,
)
from pdmesh.v1 import common_pb2, engine_pb2

pytestmark = pytest.mark.fast

POLICIES = ["prefix_aware", "round_robin", "least_loaded"]


def load(free: int = 200, total: int = 200, running: int = 0) -> LoadSnapshot:
    return LoadSnapshot(num_running=running, num_free_blocks=free, num_total_blocks=total)


def idle(*ids: str) -> list[Candidate]:
    return [Candidate(i, load()) for i in ids]


def keyed(key: str, tokens: int = 64) -> RouteRequest:
    return RouteRequest(num_prompt_tokens=tokens, block_size=16, affinity_key=key)


@pytest.mark.parametrize("name", POLICIES)
def test_a_key_keeps_its_instance_whatever_the_policy_would_pick(name: str) -> None:
    policy = make_policy(name)
    candidates = idle("a", "b", "c", "d")
    home = {key: policy.choose(keyed(key), candidates).instance_id for key in "kmnpqrs"}
    for _ in range(5):  # round robin's turn moves on; the keys stay put
        for key, instance in home.items():
            decision = policy.choose(keyed(key), candidates)
            assert (decision.instance_id, decision.affinity) == (instance, True)
    assert len(set(home.values())) > 1  # keys spread over the instances
    # Without a key the policy picks as before.
    assert not policy.choose(RouteRequest(64, 16), candidates).affinity


def test_the_key_wins_over_a_cached_prefix_elsewhere() -> None:
    policy = make_policy("prefix_aware")
    key = "tenant-7"
    home = policy.choose(keyed(key), idle("a", "b")).instance_id
    other = "b" if home == "a" else "a"
    candidates = [Candidate(home, load(free=190)), Candidate(other, load(), cached_blocks=4)]
    assert policy.choose(keyed(key), candidates).instance_id == home


def test_instances_joining_or_leaving_move_only_their_keys() -> None:
    policy = make_policy("least_loaded")
    keys = [f"session-{i}" for i in range(40)]
    before = {k: policy.choose(keyed(k), idle("a", "b", "c")).instance_id for k in keys}
    joined = {k: policy.choose(keyed(k), idle("a", "b", "c", "d")).instance_id for k in keys}
    assert all(joined[k] in (before[k], "d") for k in keys)  # a key moves only to the new one
    left = {k: policy.choose(keyed(k), idle("a", "c")).instance_id for k in keys}
    assert all(left[k] == before[k] for k in keys if before[k] != "b")
    # Re-routing leaves the failed instance out: its keys go to their next instance.
    assert all(left[k] in ("a", "c") for k in keys)


@pytest.mark.parametrize(("home_load", "stays"), [
    (load(free=30), True),  # 85 % of its KV active: still takes its keys
    (load(free=20), False),  # 90 %: overloaded
    (load(running=AFFINITY_MAX_EXTRA_REQUESTS), True),
    (load(running=AFFINITY_MAX_EXTRA_REQUESTS + 1), False),  # its work queues: others start now
])
def test_an_overloaded_instance_gives_its_keys_to_the_policy(home_load: LoadSnapshot,
                                                             stays: bool) -> None:
    key = "hot"
    home = affinity_candidate(keyed(key), idle("a", "b"))
    assert home is not None
    other = "b" if home.instance_id == "a" else "a"
    candidates = [Candidate(home.instance_id, home_load), Candidate(other, load())]
    decision = make_policy("least_loaded").choose(keyed(key), candidates)
    assert (decision.instance_id == home.instance_id) is stays
    assert decision.affinity is stays


def test_the_decision_is_counted_under_its_own_reason() -> None:
    policy = make_policy("prefix_aware")
    lookup = Lookup({}, consulted=True, ok=True)
    decision = policy.choose(keyed("k"), idle("a", "b"))
    assert decision_reason(policy, decision, 2, lookup) == "prompt_cache_key"
    assert decision_reason(policy, decision, 1, lookup) == "single_candidate"
    assert decision_reason(policy, policy.choose(RouteRequest(64, 16), idle("a", "b")), 2,
                           lookup) == "load"


class StandInPool:
    """The pool as the planner reads it: live decode instances, no prefix index."""

    block_size = 16
    scheme = None
    index_detail = ""

    def __init__(self, ids: list[str]) -> None:
        self.instances = [
            Instance(address=f"127.0.0.1:{port}", role="decode", channel=None,  # type: ignore[arg-type]
                     info=engine_pb2.EngineInfo(instance_id=i), healthy=True)
            for port, i in enumerate(ids, 9000)]

    def routable(self, role: str) -> list[Instance]:
        return [i for i in self.instances if i.serves(role)]


def test_the_planner_routes_a_request_by_its_key() -> None:
    pool = StandInPool(["a", "b", "c"])
    policies = {"decode": make_policy("least_loaded"), "prefill": make_policy("least_loaded")}
    planner = Planner(pool, policies, None, PrefillDecider(1 << 30),  # type: ignore[arg-type]
                      router_metrics(CollectorRegistry()))

    def request(key: str) -> PreparedRequest:
        return PreparedRequest(request_id="r", prompt_token_ids=list(range(40)),
                               sampling=common_pb2.SamplingParams(), n=1, max_tokens=4,
                               cache_salt="", priority=0, stream=False, received_at=0.0,
                               deadline=1e18, prompt_cache_key=key)

    home = affinity_candidate(keyed("tenant"), idle("a", "b", "c"))
    assert home is not None
    for _ in range(3):
        plan = asyncio.run(planner.plan(request("tenant")))
        assert plan.decode.instance_id == home.instance_id and plan.prefill is None
        assert plan.route.affinity_key == "tenant"  # kept for re-routing
        plan.decode.request_started(3)  # now the busiest: least_loaded alone would move on
