"""The gateway's vLLM-compatible surface beside generation: /ping, /v1/models entries with
vLLM's fields, and `--max-logprobs`. In-process, against a stand-in router client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pdmesh.gateway.app import create_app
from pdmesh.gateway.config import GatewayConfig
from pdmesh.gateway.router_client import RouterHealth
from pdmesh.v1 import router_pb2

pytestmark = pytest.mark.fast


class StandInRouter:
    """What the routes under test ask of the router client."""

    def __init__(self) -> None:
        self.serving = True

    async def healthy(self) -> RouterHealth:
        if self.serving:
            return RouterHealth(True, "SERVING")
        return RouterHealth(False, "NOT_SERVING", "no decode instance")

    async def list_models(self) -> list[router_pb2.ModelInfo]:
        return [router_pb2.ModelInfo(id="chat", max_model_len=2048, num_instances=2)]


@pytest.fixture(name="router")
def router_fixture() -> StandInRouter:
    return StandInRouter()


@pytest.fixture(name="http")
def http_fixture(router: StandInRouter) -> Iterator[TestClient]:
    config = GatewayConfig(model_root="/models/SmolLM2", max_logprobs=5, api_key="k")
    with TestClient(create_app(config, client=router)) as http:  # type: ignore[arg-type]
        yield http


def test_ping_answers_as_health_does(http: TestClient, router: StandInRouter) -> None:
    health = http.get("/health")
    for method in ("GET", "POST"):
        ping = http.request(method, "/ping")  # no API key: open, as /health is
        assert (ping.status_code, ping.json()) == (health.status_code, health.json()) == (
            200, {"status": "ok", "router": "SERVING"})
    router.serving = False
    assert http.get("/ping").status_code == 503 and http.post("/ping").status_code == 503


def test_model_entries_carry_vllms_fields(http: TestClient) -> None:
    (card,) = http.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"]
    assert card["id"] == "chat" and card["object"] == "model"
    assert card["root"] == "/models/SmolLM2" and card["parent"] is None
    assert card["max_model_len"] == 2048
    (permission,) = card["permission"]
    assert permission["object"] == "model_permission"
    assert permission["id"].startswith("modelperm-") and permission["created"] == card["created"]
    assert permission["allow_sampling"] and permission["allow_logprobs"]
    assert not permission["allow_fine_tuning"] and permission["organization"] == "*"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 9}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    ("/v1/responses", {"input": "x", "include": ["message.output_text.logprobs"],
                       "top_logprobs": 6}, "top_logprobs"),
])
def test_more_logprobs_than_max_logprobs_is_a_400(
    http: TestClient, path: str, body: dict[str, Any], param: str,
) -> None:
    resp = http.post(path, json=body, headers={"Authorization": "Bearer k"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and "max allowed: 5" in error["message"], error


def test_max_logprobs_is_bounded_by_what_engines_return() -> None:
    with pytest.raises(ValueError, match="--max-logprobs must be in"):
        GatewayConfig(max_logprobs=21)
    with pytest.raises(ValueError, match="--uvicorn-log-level"):
        GatewayConfig(uvicorn_log_level="loud")
    assert GatewayConfig(uvicorn_log_level="trace").uvicorn_log_level == "trace"


def test_logprobs_up_to_the_limit_pass() -> None:
    from pdmesh.gateway.chat_schemas import ChatCompletionRequest
    from pdmesh.gateway.completion_schemas import CompletionRequest
    from pdmesh.gateway.logprobs_limit import check_max_logprobs

    check_max_logprobs(CompletionRequest(prompt="x", logprobs=5, prompt_logprobs=5), 5)
    check_max_logprobs(ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=5), 5)
