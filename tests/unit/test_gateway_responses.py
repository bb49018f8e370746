"""/v1/responses: the request → the router's Generate call (as the chat completion it amounts
to), router messages → the response object, and a stream's Responses events in order. The
route runs in-process against a stand-in router client that answers Generate with scripted
router messages, as the engines' deltas reach the gateway."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import openai
import pytest
from fastapi.testclient import TestClient

from pdmesh.gateway.app import create_app
from pdmesh.gateway.config import GatewayConfig
from pdmesh.gateway.errors import error_from_rpc
from pdmesh.gateway.formatter import Outputs, ResponseHead
from pdmesh.gateway.openai_format import SequenceState
from pdmesh.gateway.responses_formatter import ResponsesFormatter
from pdmesh.gateway.responses_schemas import ResponsesRequest
from pdmesh.gateway.schemas import UsageInfo
from pdmesh.gateway.translate import responses_plan
from pdmesh.v1 import common_pb2, router_pb2

pytestmark = pytest.mark.fast

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def _delta(text: str, finish: int | None = None, message: str = "") -> router_pb2.GenerateResponse:
    delta = common_pb2.SequenceDelta(index=0, token_ids=[7] * max(1, len(text)), text=text)
    if finish is not None:
        delta.finish.CopyFrom(common_pb2.Finish(reason=finish, message=message))
    return router_pb2.GenerateResponse(delta=delta)


def _result(prompt: int, completion: int, cached: int = 0) -> router_pb2.GenerateResponse:
    return router_pb2.GenerateResponse(result=router_pb2.GenerateResult(usage=common_pb2.Usage(
        prompt_tokens=prompt, completion_tokens=completion, cached_prompt_tokens=cached)))


STOPPED = [_delta("Hel"), _delta("lo"), _delta("!", common_pb2.FINISH_REASON_STOP),
           _result(9, 3, cached=4)]
CUT = [_delta("Hel"), _delta("lo", common_pb2.FINISH_REASON_LENGTH), _result(9, 2)]


class StandInCall:
    def __init__(self, script: list[router_pb2.GenerateResponse] | str) -> None:
        self.script = script  # a str: the router refuses with INVALID_ARGUMENT, these words
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[router_pb2.GenerateResponse]:
        if isinstance(self.script, str):
            raise error_from_rpc(grpc.aio.AioRpcError(
                grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                self.script))
        for message in self.script:
            yield message

    def close(self) -> None:
        self.closed = True


class StandInRouter:
    """Answers every Generate with `script` and keeps what it was asked."""

    def __init__(self) -> None:
        self.script: list[router_pb2.GenerateResponse] | str = STOPPED
        self.requests: list[router_pb2.GenerateRequest] = []
        self.calls: list[StandInCall] = []

    def generate(self, request: router_pb2.GenerateRequest,
                 metadata: tuple[tuple[str, str], ...] = ()) -> StandInCall:
        self.requests.append(request)
        self.calls.append(StandInCall(self.script))
        return self.calls[-1]

    async def list_models(self) -> list[router_pb2.ModelInfo]:
        return [router_pb2.ModelInfo(id="served")]


@pytest.fixture(name="router")
def router_fixture() -> StandInRouter:
    return StandInRouter()


@pytest.fixture(name="http")
def http_fixture(router: StandInRouter) -> Iterator[TestClient]:
    with TestClient(create_app(GatewayConfig(), client=router)) as http:  # type: ignore[arg-type]
        yield http


def _generate(body: dict[str, Any]) -> router_pb2.GenerateRequest:
    (request,) = responses_plan(ResponsesRequest.model_validate(body), "r1").requests
    return request


# -- the request -----------------------------------------------------------------------------------
def test_input_text_and_instructions_become_a_chat_prompt() -> None:
    g = _generate({"model": "m", "input": "Hi", "instructions": "Be brief.",
                   "max_output_tokens": 9, "temperature": 0.0, "top_p": 0.5, "top_k": 3,
                   "seed": 1, "stop": ["\n"], "user": "u", "metadata": {"k": "v"},
                   "store": True, "stream": True, "prompt_cache_key": "conv-1",
                   "chat_template_kwargs": {"enable_thinking": False}})
    assert (g.request_id, g.model, g.stream, g.prompt_cache_key) == ("r1", "m", True, "conv-1")
    assert json.loads(g.chat.chat_template_kwargs_json) == {"enable_thinking": False}
    assert [(m.role, m.content) for m in g.chat.messages] == [
        ("system", "Be brief."), ("user", "Hi")]
    s = g.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.seed, list(s.stop)) == (9, 0.0, 3, 1, ["\n"])
    assert s.top_p == pytest.approx(0.5) and not s.HasField("structured_output")


def test_message_items_keep_their_roles_and_join_text_parts() -> None:
    g = _generate({"input": [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "A "}, {"type": "input_text", "text": "B"}]},
        {"id": "msg_1", "status": "completed", "type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "C"}]},
        {"role": "user", "content": "D"},
    ]})
    assert [(m.role, m.content) for m in g.chat.messages] == [
        ("developer", "Rules."), ("user", "A B"), ("assistant", "C"), ("user", "D")]
    s = g.sampling
    assert not s.HasField("max_tokens") and not s.HasField("temperature")  # router defaults


@pytest.mark.parametrize(("fmt", "kind", "value"), [
    ({"type": "json_schema", "name": "person", "schema": PERSON}, "json_schema", PERSON),
    ({"type": "json_object"}, "json_object", True),
    ({"type": "text"}, None, None),
])
def test_text_format_is_a_structured_output(fmt: dict[str, Any], kind: str | None,
                                            value: Any) -> None:
    so = _generate({"input": "x", "text": {"format": fmt}}).sampling.structured_output
    assert so.WhichOneof("kind") == kind
    if kind == "json_schema":
        assert json.loads(so.json_schema) == value
    elif kind is not None:
        assert getattr(so, kind) == value


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "stores no"),
    ({"input": "x", "background": True}, "background", "store"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools", "chat"),
    ({"input": "x", "text": {"format": {"type": "json_object"}},
      "structured_outputs": {"regex": "a"}}, "structured_outputs", "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format",
     "schema"),
    ({"input": []}, "input", "at least 1"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input",
     "input[0]: items of type 'function_call_output'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input", "input[0].content[0]: parts of type 'input_image'"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "greater than"),
])
def test_what_is_not_served_is_a_400_naming_it(http: TestClient, router: StandInRouter,
                                               body: dict[str, Any], param: str,
                                               says: str) -> None:
    resp = http.post("/v1/responses", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert router.requests == []


@pytest.mark.parametrize(("refusal", "param"), [
    ("sampling.structured_output.json_schema: the schema does not compile",
     "text.format.schema"),
    ("sampling.max_tokens: max_tokens must be at most 100", "max_output_tokens"),
    ("sampling.top_k: top_k must be -1, 0 or positive", "top_k"),
])
def test_router_refusals_name_this_bodys_fields(http: TestClient, router: StandInRouter,
                                                refusal: str, param: str) -> None:
    router.script = refusal
    body = {"input": "x", "max_output_tokens": 500, "top_k": -5,
            "text": {"format": {"type": "json_schema", "name": "n", "schema": PERSON}}}
    for stream in (False, True):  # refused before a stream starts: a status, not an event
        resp = http.post("/v1/responses", json={**body, "stream": stream})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and error["message"].startswith(param), error


def test_fields_outside_the_subset_are_ignored_and_named(http: TestClient) -> None:
    resp = http.post("/v1/responses", json={"input": "x", "reasoning": {"effort": "low"}})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ignored-fields"] == "reasoning"


# -- the response ----------------------------------------------------------------------------------
def _outputs(script: list[router_pb2.GenerateResponse]) -> Outputs:
    seq, usage = SequenceState(), UsageInfo()
    for message in script:
        if message.HasField("delta"):
            seq.add(message.delta)
        else:
            usage.add(message.result.usage)
    return Outputs(sequences={0: seq}, prompt_logprobs={}, usage=usage)


def test_whole_response() -> None:
    body = ResponsesRequest.model_validate({"input": "x", "instructions": "I",
                                            "metadata": {"k": "v"}, "temperature": 0.0})
    head = ResponseHead(id="resp_r1", created=1700, model="m")
    out = ResponsesFormatter(body, "msg_r1").whole(head, _outputs(STOPPED)).model_dump(
        mode="json")
    assert (out["id"], out["object"], out["created_at"], out["model"], out["status"]) == (
        "resp_r1", "response", 1700, "m", "completed")
    assert out["incomplete_details"] is None
    assert (out["instructions"], out["metadata"], out["temperature"]) == ("I", {"k": "v"}, 0.0)
    (item,) = out["output"]
    assert (item["id"], item["type"], item["role"], item["status"]) == (
        "msg_r1", "message", "assistant", "completed")
    assert item["content"] == [{"type": "output_text", "text": "Hello!", "annotations": [],
                                "logprobs": None}]
    assert out["usage"] == {"input_tokens": 9, "output_tokens": 3, "total_tokens": 12,
                            "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                            "output_tokens_details": {"reasoning_tokens": 0}}


def test_the_length_limit_makes_it_incomplete() -> None:
    body = ResponsesRequest.model_validate({"input": "x", "max_output_tokens": 2})
    out = ResponsesFormatter(body, "msg_r1").whole(ResponseHead("resp_r1", 1, "m"),
                                                   _outputs(CUT))
    assert out.status == "incomplete" and out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].content[0].text == "Hello" and out.max_output_tokens == 2


def test_whole_over_http(http: TestClient, router: StandInRouter) -> None:
    resp = http.post("/v1/responses", json={"model": "m", "input": "x"},
                     headers={"X-Request-Id": "abc"})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert (out["id"], out["output"][0]["id"]) == ("resp_abc", "msg_abc")
    assert out["output"][0]["content"][0]["text"] == "Hello!"
    assert router.requests[0].request_id == "abc" and router.calls[0].closed


def _events(resp: Any) -> list[tuple[str, dict[str, Any]]]:
    """(event line, data) per SSE event; every data line is an event's JSON (no [DONE])."""
    events = []
    for block in resp.text.strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: "), block
        events.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_streamed_events(http: TestClient) -> None:
    resp = http.post("/v1/responses", json={"model": "m", "input": "x", "stream": True,
                                            "metadata": {"k": "v"}},
                     headers={"X-Request-Id": "abc"})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith(
        "text/event-stream")
    events = _events(resp)
    assert all(kind == data["type"] for kind, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert [kind for kind, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 3,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    by_kind = {kind: data for kind, data in events}
    created = by_kind["response.created"]["response"]
    assert (created["id"], created["status"], created["output"], created["model"]) == (
        "resp_abc", "in_progress", [], "m")
    assert created["metadata"] == {"k": "v"} and created["usage"] is None
    added = by_kind["response.output_item.added"]
    assert added["item"]["id"] == "msg_abc" and added["item"]["status"] == "in_progress"
    deltas = [d for k, d in events if k == "response.output_text.delta"]
    assert [d["delta"] for d in deltas] == ["Hel", "lo", "!"]
    assert {(d["item_id"], d["output_index"], d["content_index"]) for d in deltas} == {
        ("msg_abc", 0, 0)}
    assert by_kind["response.output_text.done"]["text"] == "Hello!"
    assert by_kind["response.content_part.done"]["part"]["text"] == "Hello!"
    assert by_kind["response.output_item.done"]["item"]["status"] == "completed"
    done = by_kind["response.completed"]["response"]
    assert (done["status"], done["output"][0]["content"][0]["text"]) == ("completed", "Hello!")
    assert done["usage"]["input_tokens"] == 9 and done["usage"]["output_tokens"] == 3
    assert done["usage"]["input_tokens_details"]["cached_tokens"] == 4
    assert done["created_at"] == created["created_at"]


def test_streamed_cut_by_the_length_limit(http: TestClient, router: StandInRouter) -> None:
    router.script = CUT
    events = _events(http.post("/v1/responses", json={"input": "x", "stream": True,
                                                      "max_output_tokens": 2}))
    kind, last = events[-1]
    assert kind == "response.completed" and last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_failure_midway_is_an_error_event(http: TestClient, router: StandInRouter) -> None:
    router.script = [_delta("Hel"), _delta("", common_pb2.FINISH_REASON_ERROR, "engine died"),
                     _result(9, 1)]
    events = _events(http.post("/v1/responses", json={"input": "x", "stream": True}))
    kinds = [kind for kind, _ in events]
    assert kinds[-2:] == ["response.output_text.delta", "error"]
    error = events[-1][1]
    assert "engine died" in error["message"] and error["sequence_number"] == len(events) - 1
    assert router.calls[0].closed


def test_the_openai_client_reads_both(http: TestClient) -> None:
    """The official client's own types parse the answer, whole and streamed."""
    client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http,
                           max_retries=0)
    whole = client.responses.create(model="m", input="x", max_output_tokens=5)
    assert whole.output_text == "Hello!" and whole.status == "completed"
    assert whole.usage is not None and whole.usage.input_tokens_details.cached_tokens == 4
    events = list(client.responses.create(model="m", input="x", stream=True))
    assert type(events[-1]).__name__ == "ResponseCompletedEvent"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        events[-1].response.output_text == "Hello!"
