"""How `pdmesh serve` starts its children: every one drains as long as it was told and is given
that long (plus its teardown) before SIGKILL; the API key never reaches a command line; a
restarted child keeps its ports."""

from __future__ import annotations

import pytest

from pdmesh.grpc_common import TEARDOWN_BOUND_S
from pdmesh.serve import API_KEY_ENV, DRAIN_ENV, Endpoint, LocalMesh, MeshConfig

pytestmark = pytest.mark.fast

REDIS = "redis://127.0.0.1:1/0"


def mesh(**overrides: object) -> LocalMesh:
    local = LocalMesh(MeshConfig(redis_url=REDIS, **overrides), env={"PATH": "/bin"})  # type: ignore[arg-type]
    local.endpoints["router"] = Endpoint("127.0.0.1:5001", metrics_port=5002)
    return local


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_children_drain_for_the_configured_time_and_get_it_on_stop() -> None:
    local = mesh(drain_timeout_s=42.0)
    for argv in (local.engine_args("decode"), local._router_argv(), local._gateway_argv()):
        assert flag(argv, "--drain-timeout-s") == "42.0"
    assert local.stop_grace_s > 42.0 + TEARDOWN_BOUND_S
    unset = mesh()  # the children's own: their default, or their environment's
    assert "--drain-timeout-s" not in unset._router_argv()
    assert unset.stop_grace_s > 30.0 + TEARDOWN_BOUND_S
    unset.env = {DRAIN_ENV: "50"}
    assert unset.stop_grace_s > 50.0 + TEARDOWN_BOUND_S


def test_the_api_key_travels_in_the_gateway_environment_only() -> None:
    local = mesh(api_key="sk-secret")
    assert not any("sk-secret" in arg for arg in local._gateway_argv())
    assert local._gateway_env()[API_KEY_ENV] == "sk-secret"
    assert API_KEY_ENV not in (local.env or {})  # the other children never see it


def test_a_restarted_child_serves_on_its_first_ports() -> None:
    local = mesh(grpc_port=0)
    first_router = local._router_argv()  # also what tests start a second router with
    assert (flag(first_router, "--port"), flag(first_router, "--metrics-port")) == ("0", "0")
    router = local._router_argv(local.endpoints["router"])
    assert (flag(router, "--port"), flag(router, "--metrics-port")) == ("5001", "5002")
    first = local.engine_args("prefill")
    assert (flag(first, "--port"), flag(first, "--metrics-port")) == ("0", "0")
    again = local.engine_args("prefill", Endpoint("127.0.0.1:6001", metrics_port=6002))
    assert (flag(again, "--port"), flag(again, "--metrics-port")) == ("6001", "6002")
    assert flag(local._gateway_argv(), "--router-address") == "127.0.0.1:5001"
