"""Every error the gateway answers, compared field by field with vLLM's error bodies, and
router refusals naming the field as the request body wrote it. In-process, against a stand-in
router client that refuses as the router does (gRPC statuses), so a vLLM client's error
handling reads ours unchanged."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient

from pdmesh.gateway.app import create_app
from pdmesh.gateway.chat_schemas import ChatCompletionRequest
from pdmesh.gateway.completion_schemas import CompletionRequest
from pdmesh.gateway.config import GatewayConfig
from pdmesh.gateway.errors import body_field, error_from_rpc, invalid_argument
from pdmesh.gateway.info_schemas import DetokenizeRequest
from pdmesh.gateway.router_client import RouterHealth
from pdmesh.v1 import common_pb2, router_pb2

pytestmark = pytest.mark.fast

API_KEY = "k"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "Hi"}]

# -- vLLM's shapes (vLLM 0.32.0) -------------------------------------------------------------------
# vllm/entrypoints/serve/engine/protocol.py: `ErrorResponse(error: ErrorInfo)`, `ErrorInfo` with
# `message: str`, `type: str`, `param: str | None = None`, `code: int`, dumped in that order.
VLLM_ERROR_KEYS = ["message", "type", "param", "code"]
VLLM_ERROR_TYPES = {"message": str, "type": str, "param": (str, type(None)), "code": int}
# `type` and `code` (and `param` where vLLM fills one) per kind of error:
# - exception_handling/error_response.py `create_error_response`: BadRequestError 400,
#   NotFoundError 404 (`_check_model`: param "model"), InternalServerError 500 (GenerationError
#   too, also in a stream's `data: {"error": ...}` event: generate/base/serving.py);
# - exception_handling/handlers/validation.py: a body pydantic refused, "Bad Request" 400 (and
#   vLLM's body-type check, serve/utils/api_utils.py `validate_json_request`, raises the same);
# - exception_handling/handlers/http.py: Starlette's errors, the status phrase, param None;
# - exceptions.py `GracefulHTTPError`: a refusal with its own status, the status phrase;
# - middleware/authenticate.py: 401 is `{"error": "Unauthorized"}`, nothing more.
VLLM_UNAUTHORIZED = {"error": "Unauthorized"}
VLLM = {
    "validation": {"type": "Bad Request", "code": 400},
    "bad_request": {"type": "BadRequestError", "code": 400},
    "model_not_found": {"type": "NotFoundError", "param": "model", "code": 404},
    "route_not_found": {"message": "Not Found", "type": "Not Found", "param": None, "code": 404},
    "method_not_allowed": {"message": "Method Not Allowed", "type": "Method Not Allowed",
                           "param": None, "code": 405},
    "conflict": {"type": "Conflict", "param": None, "code": 409},
    "too_large": {"type": "Request Entity Too Large", "param": None, "code": 413},
    "too_many": {"type": "Too Many Requests", "param": None, "code": 429},
    "internal": {"type": "InternalServerError", "param": None, "code": 500},
    "unavailable": {"type": "Service Unavailable", "param": None, "code": 503},
    "timeout": {"type": "Gateway Timeout", "param": None, "code": 504},
}


def assert_vllm_shape(body: Any, expected: dict[str, Any]) -> dict[str, Any]:
    """`body` is vLLM's ErrorResponse: the keys in vLLM's order, each of its type, and every
    field `expected` names equal to it."""
    assert list(body) == ["error"], body
    error = body["error"]
    assert list(error) == VLLM_ERROR_KEYS, error
    for key, kind in VLLM_ERROR_TYPES.items():
        assert isinstance(error[key], kind), (key, error)
    assert not isinstance(error["code"], bool)
    for key, value in expected.items():
        assert error[key] == value, (key, error)
    return error


# -- a stand-in router -----------------------------------------------------------------------------
def rpc_error(code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()
              ) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


class StandInCall:
    """A Generate call that refuses with `error`, or streams `events`."""

    def __init__(self, error: grpc.aio.AioRpcError | None,
                 events: list[router_pb2.GenerateResponse]) -> None:
        self.error, self.events = error, events

    async def __aiter__(self) -> AsyncIterator[router_pb2.GenerateResponse]:
        if self.error is not None:
            raise error_from_rpc(self.error)
        for event in self.events:
            yield event

    def close(self) -> None:
        pass


class StandInRouter:
    """Refuses every call with `error` (a router status), or streams `events`."""

    def __init__(self) -> None:
        self.error: grpc.aio.AioRpcError | None = None
        self.events: list[router_pb2.GenerateResponse] = []

    async def healthy(self) -> RouterHealth:
        return RouterHealth(True, "SERVING")

    async def list_models(self) -> list[router_pb2.ModelInfo]:
        return [router_pb2.ModelInfo(id="chat", max_model_len=2048, num_instances=1)]

    def generate(self, request: router_pb2.GenerateRequest,
                 metadata: tuple[tuple[str, str], ...] = ()) -> StandInCall:
        return StandInCall(self.error, self.events)

    async def detokenize(self, request: router_pb2.DetokenizeRequest
                         ) -> router_pb2.DetokenizeResponse:
        if self.error is not None:
            raise error_from_rpc(self.error)
        return router_pb2.DetokenizeResponse(text="x")


@pytest.fixture(name="router")
def router_fixture() -> StandInRouter:
    return StandInRouter()


@pytest.fixture(name="http")
def http_fixture(router: StandInRouter) -> Iterator[TestClient]:
    config = GatewayConfig(api_key=API_KEY, max_request_bytes=4096, max_logprobs=5)
    app = create_app(config, client=router)  # type: ignore[arg-type]

    @app.get("/v1/fails")
    async def fails() -> None:
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as http:
        yield http


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Hi", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": CHAT, "max_tokens": 2, **fields}


# -- every status, field by field ------------------------------------------------------------------
@pytest.mark.parametrize(("body", "expected"), [
    pytest.param({}, {**VLLM["validation"], "param": "messages",
                      "message": "messages: Field required"}, id="missing-field"),
    pytest.param(chat(temperature="hot"), {**VLLM["validation"], "param": "temperature"},
                 id="wrong-type"),
    pytest.param(b"", {**VLLM["validation"], "param": None,
                       "message": "the body is empty; expected a JSON object"}, id="empty-body"),
    pytest.param(b"{not json", {**VLLM["validation"], "param": None}, id="not-json"),
    pytest.param(chat(logprobs=True, top_logprobs=6),
                 {**VLLM["bad_request"], "param": "top_logprobs"}, id="over-max-logprobs"),
])
def test_a_refused_body_is_vllms_400(http: TestClient, body: Any,
                                     expected: dict[str, Any]) -> None:
    if isinstance(body, bytes):
        resp = http.post("/v1/chat/completions", content=body,
                         headers={**AUTH, "content-type": "application/json"})
    else:
        resp = http.post("/v1/chat/completions", json=body, headers=AUTH)
    assert resp.status_code == 400, resp.text
    error = assert_vllm_shape(resp.json(), expected)
    assert error["message"]


def test_a_non_json_content_type_is_vllms_400(http: TestClient) -> None:
    resp = http.post("/v1/completions", content=b"prompt=Hi",
                     headers={**AUTH, "content-type": "text/plain"})
    assert resp.status_code == 400
    error = assert_vllm_shape(resp.json(), {**VLLM["validation"], "param": "Content-Type"})
    assert error["message"].startswith("Unsupported Media Type: Only 'application/json'")


@pytest.mark.parametrize(("code", "details", "trailing", "expected", "headers"), [
    pytest.param(grpc.StatusCode.INVALID_ARGUMENT,
                 "sampling.top_p: top_p must be in (0, 1], got 2", (),
                 {**VLLM["bad_request"], "param": "top_p",
                  "message": "top_p must be in (0, 1], got 2"}, {}, id="400"),
    pytest.param(grpc.StatusCode.NOT_FOUND,
                 "model 'gpt-none' is not served here; served: 'chat'", (),
                 VLLM["model_not_found"], {}, id="404"),
    pytest.param(grpc.StatusCode.ALREADY_EXISTS, "request_id 'r' is already in flight", (),
                 VLLM["conflict"], {}, id="409"),
    pytest.param(grpc.StatusCode.RESOURCE_EXHAUSTED, "router at capacity",
                 (("retry-after-ms", "2100"),), VLLM["too_many"], {"retry-after": "3"},
                 id="429"),
    pytest.param(grpc.StatusCode.INTERNAL, "boom", (), VLLM["internal"], {}, id="500"),
    pytest.param(grpc.StatusCode.UNAVAILABLE, "no decode instance", (),
                 VLLM["unavailable"], {"retry-after": "1"}, id="503"),
    pytest.param(grpc.StatusCode.DEADLINE_EXCEEDED, "", (), VLLM["timeout"], {}, id="504"),
])
def test_router_refusals_are_vllms_shape(
    http: TestClient, router: StandInRouter, code: grpc.StatusCode, details: str,
    trailing: tuple[tuple[str, str], ...], expected: dict[str, Any], headers: dict[str, str],
) -> None:
    router.error = rpc_error(code, details, trailing)
    for path, body in (("/v1/completions", completion(top_p=2)),
                       ("/v1/chat/completions", chat(top_p=2, stream=True))):
        resp = http.post(path, json=body, headers=AUTH)
        assert resp.status_code == expected["code"], resp.text
        assert_vllm_shape(resp.json(), expected)
        for name, value in headers.items():
            assert resp.headers[name] == value


def test_unauthorized_is_vllms_bare_body(http: TestClient) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = http.post("/v1/completions", json=completion(), headers=headers)
        assert resp.status_code == 401
        assert resp.json() == VLLM_UNAUTHORIZED
        assert resp.headers["www-authenticate"] == "Bearer"


def test_any_of_several_api_keys_is_accepted(router: StandInRouter) -> None:
    """vLLM's `--api-key k1 k2` (here `k1,k2`): either key passes, nothing else does."""
    config = GatewayConfig(api_key="k1, k2", max_logprobs=5)
    assert config.api_keys == ("k1", "k2")
    with TestClient(create_app(config, client=router)) as http:  # type: ignore[arg-type]
        statuses = [http.post("/v1/completions", json=completion(),
                              headers={"Authorization": f"Bearer {key}"}).status_code
                    for key in ("k1", "k2", "k1,k2", "k3", "")]
    assert statuses == [200, 200, 401, 401, 401]
    for blank in ("", " ", "k1,,k2", "k1, "):
        with pytest.raises(ValueError, match="--api-key must not be blank"):
            GatewayConfig(api_key=blank)


def test_framework_errors_are_vllms_shape(http: TestClient) -> None:
    assert_vllm_shape(http.get("/v1/nothing-here", headers=AUTH).json(),
                      VLLM["route_not_found"])
    resp = http.get("/v1/completions", headers=AUTH)
    assert resp.status_code == 405
    assert_vllm_shape(resp.json(), VLLM["method_not_allowed"])


def test_a_body_over_the_cap_is_413_in_vllms_shape(http: TestClient) -> None:
    resp = http.post("/v1/completions", json=completion(prompt="x" * 5000), headers=AUTH)
    assert resp.status_code == 413
    assert_vllm_shape(resp.json(), VLLM["too_large"])


def test_an_unexpected_exception_is_vllms_500(http: TestClient) -> None:
    resp = http.get("/v1/fails", headers=AUTH)
    assert resp.status_code == 500
    error = assert_vllm_shape(resp.json(), VLLM["internal"])
    assert "a bug" in error["message"]


def test_a_failed_generation_is_vllms_500_whole_and_streamed(
    http: TestClient, router: StandInRouter,
) -> None:
    failed = common_pb2.Finish(reason=common_pb2.FINISH_REASON_ERROR, message="engine died")
    router.events = [router_pb2.GenerateResponse(delta=common_pb2.SequenceDelta(
        index=0, token_ids=[1], text="a", finish=failed))]
    whole = http.post("/v1/completions", json=completion(), headers=AUTH)
    assert whole.status_code == 500
    assert_vllm_shape(whole.json(), VLLM["internal"])
    streamed = http.post("/v1/chat/completions", json=chat(stream=True), headers=AUTH)
    assert streamed.status_code == 200
    events = [line.removeprefix("data: ") for line in streamed.text.splitlines()
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = assert_vllm_shape(json.loads(events[-2]), VLLM["internal"])
    assert "engine died" in error["message"]


# -- router fields named as the body wrote them ----------------------------------------------------
@pytest.mark.parametrize(("path", "body", "router_says", "param", "message"), [
    ("/v1/completions", completion(guided_regex="(ab"),
     "sampling.structured_output.regex: structured_output.regex does not compile: unbalanced",
     "guided_regex", "guided_regex does not compile: unbalanced"),
    ("/v1/completions", completion(structured_outputs={"regex": "(ab"}),
     "sampling.structured_output.regex: structured_output.regex does not compile: unbalanced",
     "structured_outputs.regex", "structured_outputs.regex does not compile: unbalanced"),
    ("/v1/chat/completions", chat(structured_outputs={"json": {"type": "nope"}}),
     "sampling.structured_output.json_schema: structured_output.json_schema does not compile: x",
     "structured_outputs.json", "structured_outputs.json does not compile: x"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "nope"}}}),
     "sampling.structured_output.json_schema: structured_output.json_schema did not compile "
     "within the 1 s budget", "response_format.json_schema",
     "response_format.json_schema did not compile within the 1 s budget"),
    ("/v1/completions", completion(guided_json={"type": "nope"}),
     "sampling.structured_output.json_schema: structured_output.json_schema does not compile: x",
     "guided_json", "guided_json does not compile: x"),
    ("/v1/completions", completion(temperature=-1),
     "sampling.temperature: temperature must be >= 0 and finite, got -1.0",
     "temperature", "temperature must be >= 0 and finite, got -1.0"),
    ("/v1/chat/completions", chat(max_completion_tokens=4000),
     "sampling.max_tokens: 4000 tokens do not fit: the prompt has 9 tokens and max_model_len "
     "is 2048", "max_completion_tokens",
     "max_completion_tokens: 4000 tokens do not fit: the prompt has 9 tokens and max_model_len "
     "is 2048"),
    ("/v1/chat/completions", chat(), "prompt: 3000 tokens leave no room to generate within "
     "max_model_len=2048", "messages",
     "messages: 3000 tokens leave no room to generate within max_model_len=2048"),
    ("/v1/completions", completion(prompt=[7]), "prompt.token_ids: token id 7 is outside [0, 5)",
     "prompt", "prompt: token id 7 is outside [0, 5)"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=3),
     "sampling.logprobs: logprobs must be in [0, 2], got 3", "top_logprobs",
     "top_logprobs must be in [0, 2], got 3"),
    ("/detokenize", {"tokens": [9]}, "token_ids: token id 9 is outside [0, 5)", "tokens",
     "tokens: token id 9 is outside [0, 5)"),
])
def test_router_refusals_name_the_field_as_the_body_did(
    http: TestClient, router: StandInRouter, path: str, body: dict[str, Any],
    router_says: str, param: str, message: str,
) -> None:
    router.error = rpc_error(grpc.StatusCode.INVALID_ARGUMENT, router_says)
    resp = http.post(path, json=body, headers=AUTH)
    assert resp.status_code == 400, resp.text
    error = assert_vllm_shape(resp.json(), {**VLLM["bad_request"], "param": param})
    assert error["message"] == message
    assert "sampling." not in error["message"] and "structured_output." not in error["message"]


def test_without_a_body_the_router_fields_take_their_usual_names() -> None:
    """Refusals outside a body's handler (or before one is parsed) still drop the router's
    paths, naming vLLM's fields."""
    said = error_from_rpc(rpc_error(grpc.StatusCode.INVALID_ARGUMENT,
                                    "sampling.structured_output.regex: structured_output.regex "
                                    "does not compile: x"))
    assert (said.param, said.message) == ("structured_outputs.regex",
                                          "structured_outputs.regex does not compile: x")
    assert body_field("sampling.stop_token_ids") == "stop_token_ids"
    assert body_field("chat.messages") == "messages"
    assert body_field("chat.tools_json") == "tools"
    assert body_field("chat.add_generation_prompt") == "add_generation_prompt"
    assert body_field("sampling.bad_words") == "bad_words"
    assert body_field("sampling.structured_output") == "structured_outputs"
    headless = invalid_argument("stream_interval must be an integer >= 1, got 0")
    assert (headless.param, headless.message) == (
        "stream_interval", "stream_interval must be an integer >= 1, got 0")
    plain = invalid_argument("something the router did not tie to a field")
    assert (plain.param, plain.message) == (None, "something the router did not tie to a field")


def test_the_body_picks_among_the_names_a_field_may_have() -> None:
    chat_body = ChatCompletionRequest.model_validate(chat(max_tokens=3))
    assert body_field("sampling.max_tokens", chat_body) == "max_tokens"
    assert body_field("prompt", chat_body) == "messages"
    assert body_field("prompt", CompletionRequest.model_validate(completion())) == "prompt"
    assert body_field("token_ids", DetokenizeRequest.model_validate({"tokens": [1]})) == "tokens"
    tools = ChatCompletionRequest.model_validate(chat(
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        tool_choice="required"))
    assert body_field("sampling.structured_output.json_schema", tools) == "tools"
