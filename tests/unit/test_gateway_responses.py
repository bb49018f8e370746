"""/v1/responses: the request → the router's Generate call (as the chat completion it amounts
to, function tools and tool-call history included), router messages → the response object
(a message, function calls), and a stream's Responses events in order. The route runs
in-process against a stand-in router client that answers Generate with scripted router
messages, as the engines' deltas reach the gateway."""

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
from pdmesh.gateway.responses_output import OutputMessage
from pdmesh.gateway.responses_schemas import ResponsesRequest
from pdmesh.gateway.schemas import UsageInfo
from pdmesh.gateway.tools import ToolPlan, ToolSettings
from pdmesh.gateway.translate import responses_plan
from pdmesh.v1 import common_pb2, router_pb2

pytestmark = pytest.mark.fast

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"]}
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Current weather",
     "parameters": WEATHER_PARAMS},
    {"type": "function", "name": "get_time", "strict": True},
]
WEATHER: Any = {"type": "function", "name": "get_weather"}
NO_AUTO = ToolSettings()
AUTO = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")


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
NAMED = [_delta('{"city": '), _delta('"Paris"}', common_pb2.FINISH_REASON_STOP), _result(9, 2)]
"""What a named function's structured output makes: its arguments, streamed."""
HERMES = [_delta("Checking.\n"), _delta('<tool_call>\n{"name": "get_time", "arguments": '),
          _delta('{"zone": 2}}\n</tool_call>', common_pb2.FINISH_REASON_STOP), _result(9, 3)]
"""Content, then a call in the hermes format (tool_choice "auto")."""


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


@pytest.fixture(name="http_auto")
def http_auto_fixture(router: StandInRouter) -> Iterator[TestClient]:
    """The gateway as `--enable-auto-tool-choice --tool-call-parser hermes` starts it."""
    config = GatewayConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with TestClient(create_app(config, client=router)) as http:  # type: ignore[arg-type]
        yield http


def _generate(body: dict[str, Any],
              settings: ToolSettings = NO_AUTO) -> router_pb2.GenerateRequest:
    (request,) = responses_plan(ResponsesRequest.model_validate(body), "r1", settings).requests
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
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools",
     "tools[0]: tools of type 'web_search' are not supported (only function tools)"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name",
     "pattern"),
    ({"input": "x", "tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice", "'nope', which is not in tools (get_weather, get_time)"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "mcp", "server_label": "s"}},
     "tool_choice", "type 'mcp' is not supported"),
    ({"input": "x", "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'sometimes'"),
    ({"input": "x", "tools": TOOLS, "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "tool_choice",
     "cannot be combined with text.format or structured_outputs"),
    ({"input": "x", "text": {"format": {"type": "json_object"}},
      "structured_outputs": {"regex": "a"}}, "structured_outputs", "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format",
     "schema"),
    ({"input": []}, "input", "at least 1"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input",
     "input[0]: items of type 'web_search_call' are not supported"),
    ({"input": [{"type": "reasoning", "content": [{"type": "input_text", "text": "x"}]}]},
     "input", "input[0].content[0]: parts of type 'input_text' are not supported (only "
     "reasoning_text)"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call", "name": "f", "arguments": "{}"}]}, "input",
     "input[1].call_id: Field required"),
    ({"input": [{"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_file", "file_id": "f"}]}]}, "input",
     "input[0].output[0]: parts of type 'input_file'"),
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
    ("sampling.logprobs: logprobs must be in [0, 20], got 19", "top_logprobs"),
])
def test_router_refusals_name_this_bodys_fields(http: TestClient, router: StandInRouter,
                                                refusal: str, param: str) -> None:
    router.script = refusal
    body = {"input": "x", "max_output_tokens": 500, "top_k": -5,
            "include": ["message.output_text.logprobs"], "top_logprobs": 19,  # the router's
            # word (a scripted refusal): over --max-logprobs the gateway refuses it first
            "text": {"format": {"type": "json_schema", "name": "n", "schema": PERSON}}}
    for stream in (False, True):  # refused before a stream starts: a status, not an event
        resp = http.post("/v1/responses", json={**body, "stream": stream})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and error["message"].startswith(param), error


def test_fields_outside_the_subset_are_ignored_and_named(http: TestClient) -> None:
    resp = http.post("/v1/responses", json={"input": "x", "truncation": "auto",
                                            "reasoning": {"effort": "low"}})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ignored-fields"] == "truncation"  # reasoning.effort is taken


# -- function tools: the request -------------------------------------------------------------------
def _tools_json(g: router_pb2.GenerateRequest) -> list[dict[str, Any]]:
    return json.loads(g.chat.tools_json)


def test_flat_function_tools_reach_the_template_as_chats() -> None:
    g = _generate({"input": "x", "tools": TOOLS, "tool_choice": "none"})
    assert _tools_json(g) == [
        {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                          "parameters": WEATHER_PARAMS}},
        {"type": "function", "function": {"name": "get_time", "strict": True}}]
    assert not g.sampling.HasField("structured_output")  # "none": plain text


def test_a_named_function_is_forced_by_its_parameters_schema() -> None:
    so = _generate({"input": "x", "tools": TOOLS, "tool_choice": WEATHER}).sampling
    assert json.loads(so.structured_output.json_schema) == WEATHER_PARAMS


def test_required_is_forced_to_an_array_of_calls() -> None:
    g = _generate({"input": "x", "tools": TOOLS, "tool_choice": "required",
                   "parallel_tool_calls": False})
    schema = json.loads(g.sampling.structured_output.json_schema)
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    names = [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]


def test_auto_is_the_default_with_tools_and_leaves_the_output_free() -> None:
    g = _generate({"input": "x", "tools": TOOLS}, AUTO)
    assert len(_tools_json(g)) == 2 and not g.sampling.HasField("structured_output")
    # Without tools, "auto" (the default) is "none", as vLLM reads it.
    assert _generate({"input": "x", "tool_choice": "auto"}).chat.tools_json == ""


def test_calls_and_their_outputs_continue_the_conversation() -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"}
    g = _generate({"instructions": "Be brief.", "tools": TOOLS, "tool_choice": "none", "input": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking."}]},
        call,  # joins the message before it: one turn that spoke and called
        {**call, "call_id": "call_2", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "rain"}]},
        {**call, "call_id": "call_3"},  # a turn of calls only: an assistant message of its own
        {"type": "function_call_output", "call_id": "call_3", "output": "still sunny"},
    ]})
    got = [(m.role, m.content, [(c.id, c.name, c.arguments) for c in m.tool_calls],
            m.tool_call_id) for m in g.chat.messages]
    assert got == [
        ("system", "Be brief.", [], ""),
        ("user", "Weather in Paris and Rome?", [], ""),
        ("assistant", "Checking.", [("call_1", "get_weather", '{"city": "Paris"}'),
                                    ("call_2", "get_weather", '{"city": "Rome"}')], ""),
        ("tool", "sunny", [], "call_1"),
        ("tool", "rain", [], "call_2"),
        ("assistant", "", [("call_3", "get_weather", '{"city": "Paris"}')], ""),
        ("tool", "still sunny", [], "call_3"),
    ]


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
    out = ResponsesFormatter(body, "r1").whole(head, _outputs(STOPPED)).model_dump(
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
    out = ResponsesFormatter(body, "r1").whole(ResponseHead("resp_r1", 1, "m"), _outputs(CUT))
    assert out.status == "incomplete" and out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"
    (item,) = out.output
    assert isinstance(item, OutputMessage) and item.content[0].text == "Hello"
    assert out.max_output_tokens == 2


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


# -- function tools: the response ------------------------------------------------------------------
def _plan_formatter(body: dict[str, Any],
                    settings: ToolSettings = NO_AUTO) -> ResponsesFormatter:
    formatter = responses_plan(ResponsesRequest.model_validate(body), "r1", settings).formatter
    assert isinstance(formatter, ResponsesFormatter) and isinstance(formatter.reply.tools, ToolPlan)
    return formatter


def test_whole_named_call_is_a_function_call_item() -> None:
    formatter = _plan_formatter({"input": "x", "tools": TOOLS, "tool_choice": WEATHER})
    out = formatter.whole(ResponseHead("resp_r1", 1, "m"), _outputs(NAMED)).model_dump(
        mode="json")
    (item,) = out["output"]  # no message: the output is the call
    assert item["call_id"].startswith("chatcmpl-tool-")
    assert {k: v for k, v in item.items() if k != "call_id"} == {
        "id": "fc_r1_0", "type": "function_call", "name": "get_weather",
        "arguments": '{"city": "Paris"}', "status": "completed"}
    assert out["status"] == "completed"
    assert out["tool_choice"] == WEATHER and out["parallel_tool_calls"] is True
    assert [t["name"] for t in out["tools"]] == ["get_weather", "get_time"]


def test_whole_auto_is_the_message_then_the_calls() -> None:
    formatter = _plan_formatter({"input": "x", "tools": TOOLS}, AUTO)
    out = formatter.whole(ResponseHead("resp_r1", 1, "m"), _outputs(HERMES))
    message, call = out.output
    assert isinstance(message, OutputMessage) and message.id == "msg_r1"
    assert message.content[0].text == "Checking.\n"
    assert call.type == "function_call" and call.id == "fc_r1_0"
    assert (call.name, json.loads(call.arguments)) == ("get_time", {"zone": 2})
    assert out.tool_choice == "auto"


def test_streamed_named_call(http: TestClient, router: StandInRouter) -> None:
    router.script = NAMED
    events = _events(http.post("/v1/responses", json={
        "input": "x", "stream": True, "tools": TOOLS, "tool_choice": WEATHER},
        headers={"X-Request-Id": "abc"}))
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert [kind for kind, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * 2,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    added = events[2][1]["item"]
    assert (added["type"], added["id"], added["name"], added["arguments"], added["status"]) == (
        "function_call", "fc_abc_0", "get_weather", "", "in_progress")
    assert [d["delta"] for _, d in events[3:5]] == ['{"city": ', '"Paris"}']
    assert {(d["item_id"], d["output_index"]) for _, d in events[3:6]} == {("fc_abc_0", 0)}
    done = events[5][1]
    assert (done["name"], done["arguments"]) == ("get_weather", '{"city": "Paris"}')
    item = events[6][1]["item"]
    assert item == {**added, "arguments": '{"city": "Paris"}', "status": "completed"}
    final = events[-1][1]["response"]
    assert final["output"] == [item] and final["status"] == "completed"


def test_streamed_auto_closes_the_message_when_a_call_opens(http_auto: TestClient,
                                                            router: StandInRouter) -> None:
    router.script = HERMES
    events = _events(http_auto.post("/v1/responses", json={"input": "x", "stream": True,
                                                           "tools": TOOLS}))
    assert [kind for kind, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    indices = [d.get("output_index") for _, d in events[2:-1]]
    assert indices == [0] * 6 + [1] * 4
    assert events[4][1]["delta"] == "Checking.\n"
    message, call = events[-1][1]["response"]["output"]
    assert message == events[7][1]["item"] and call == events[11][1]["item"]
    assert message["content"][0]["text"] == "Checking.\n"
    assert (call["name"], json.loads(call["arguments"])) == ("get_time", {"zone": 2})


def test_the_openai_client_reads_function_calls(http: TestClient, router: StandInRouter) -> None:
    """The official client's types parse function call items and events."""
    client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http,
                           max_retries=0)
    router.script = NAMED
    whole = client.responses.create(model="m", input="x", tools=TOOLS, tool_choice=WEATHER)
    (call,) = whole.output
    assert type(call).__name__ == "ResponseFunctionToolCall" and whole.output_text == ""
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    events = list(client.responses.create(model="m", input="x", tools=TOOLS,
                                          tool_choice=WEATHER, stream=True))
    kinds = {type(e).__name__ for e in events}
    assert {"ResponseFunctionCallArgumentsDeltaEvent",
            "ResponseFunctionCallArgumentsDoneEvent"} <= kinds
    final = events[-1].response
    assert final.output[0].type == "function_call"
    assert final.output[0].arguments == '{"city": "Paris"}'


# -- output logprobs -------------------------------------------------------------------------------
LOGPROBS: list[Any] = ["message.output_text.logprobs"]


def _lp(text: str, logprob: float, *top: tuple[str, float]) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=7, logprob=logprob, rank=1, text=text, top=[
        common_pb2.TokenLogprob.Candidate(token_id=8, logprob=lp, text=t) for t, lp in top])


def _delta_lp(text: str, *logprobs: common_pb2.TokenLogprob,
              finish: int | None = None) -> router_pb2.GenerateResponse:
    message = _delta(text, finish)
    del message.delta.token_ids[:]
    message.delta.token_ids.extend([7] * len(logprobs))
    message.delta.logprobs.extend(logprobs)
    return message


HEL = _lp("Hel", -0.5, ("Hel", -0.5), ("He", -1.0))
LO = _lp("lo", -0.25, ("lo", -0.25), ("l", -2.0))
HALF = _lp("\ufffd", -1.5, ("\ufffd", -1.5), ("x", -3.0))  # a character's first bytes: no text yet
EURO = _lp("\u20ac", -0.125, ("\u20ac", -0.125), ("e", -float("inf")))
END = _lp("", -0.0625, ("", -0.0625), ("!", -4.0))  # the end token: no text of its own
WITH_LOGPROBS = [_delta_lp("Hel", HEL), _delta_lp("lo", LO), _delta_lp("", HALF),
                 _delta_lp("\u20ac", EURO),
                 _delta_lp("", END, finish=common_pb2.FINISH_REASON_STOP), _result(9, 5)]
"""Five tokens: one held back (a partial character) until the next brings its text, and the
last with no text at all."""


def _entry(lp: common_pb2.TokenLogprob, k: int = 2) -> dict[str, Any]:
    """The output text part's entry for `lp` (vLLM's shape; -inf floored at -9999)."""
    return {"token": lp.text, "logprob": lp.logprob, "bytes": list(lp.text.encode()),
            "top_logprobs": [{"token": c.text, "logprob": max(c.logprob, -9999.0),
                              "bytes": list(c.text.encode())} for c in lp.top[:k]]}


def _streamed(lp: common_pb2.TokenLogprob) -> dict[str, Any]:
    """The delta event's entry for `lp`: no bytes."""
    entry = _entry(lp)
    return {"token": entry["token"], "logprob": entry["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                             for t in entry["top_logprobs"]]}


@pytest.mark.parametrize(("asked", "k"), [
    ({"include": LOGPROBS, "top_logprobs": 2}, 2),
    ({"include": LOGPROBS}, 0),  # the sampled token's own logprob only
    ({"include": LOGPROBS, "top_logprobs": None}, 0),  # null is 0 (vLLM's)
    ({"include": ["reasoning.encrypted_content", *LOGPROBS], "top_logprobs": 20}, 20),
    ({"top_logprobs": 5}, None),  # without the include: ignored (vLLM's)
    ({"include": ["reasoning.encrypted_content", "file_search_call.results"]}, None),
    ({"include": []}, None),
])
def test_include_logprobs_asks_chats_logprobs(asked: dict[str, Any], k: int | None) -> None:
    body = ResponsesRequest.model_validate({"input": "x", **asked})
    chat = body.to_chat()
    assert (chat.logprobs, chat.top_logprobs) == ((False, None) if k is None else (True, k))
    g = _generate({"input": "x", **asked})
    assert (g.sampling.logprobs if g.sampling.HasField("logprobs") else None) == k


@pytest.mark.parametrize(("body", "param"), [
    ({"include": ["message.output_text.tokens"]}, "include"),  # not a value vLLM lists
    ({"include": "message.output_text.logprobs"}, "include"),
    ({"include": LOGPROBS, "top_logprobs": -1}, "top_logprobs"),
])
def test_bad_include_or_top_logprobs_is_a_400(http: TestClient, router: StandInRouter,
                                              body: dict[str, Any], param: str) -> None:
    resp = http.post("/v1/responses", json={"input": "x", **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].startswith(param), resp.json()
    assert router.requests == []


def test_include_and_top_logprobs_are_not_ignored(http: TestClient) -> None:
    resp = http.post("/v1/responses", json={"input": "x", "include": LOGPROBS,
                                            "top_logprobs": 2})
    assert resp.status_code == 200, resp.text
    assert "x-ignored-fields" not in resp.headers


def test_whole_output_logprobs() -> None:
    body = ResponsesRequest.model_validate({"input": "x", "include": LOGPROBS,
                                            "top_logprobs": 2})
    out = ResponsesFormatter(body, "r1").whole(
        ResponseHead("resp_r1", 1, "m"), _outputs(WITH_LOGPROBS)).model_dump(mode="json")
    (part,) = out["output"][0]["content"]
    assert part["text"] == "Hello\u20ac"
    assert part["logprobs"] == [_entry(lp) for lp in (HEL, LO, HALF, EURO, END)]
    assert part["logprobs"][3]["top_logprobs"][1]["logprob"] == -9999.0
    assert out["top_logprobs"] == 2


def test_whole_without_the_include_has_no_logprobs() -> None:
    body = ResponsesRequest.model_validate({"input": "x", "top_logprobs": 2})
    out = ResponsesFormatter(body, "r1").whole(
        ResponseHead("resp_r1", 1, "m"), _outputs(WITH_LOGPROBS)).model_dump(mode="json")
    assert out["output"][0]["content"][0]["logprobs"] is None and out["top_logprobs"] is None


def test_top_logprobs_zero_lists_no_alternatives() -> None:
    body = ResponsesRequest.model_validate({"input": "x", "include": LOGPROBS})
    out = ResponsesFormatter(body, "r1").whole(
        ResponseHead("resp_r1", 1, "m"), _outputs(WITH_LOGPROBS))
    logprobs = out.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert logprobs is not None and [lp.token for lp in logprobs] == [
        "Hel", "lo", "\ufffd", "\u20ac", ""]
    assert all(lp.top_logprobs == [] for lp in logprobs) and out.top_logprobs == 0


def test_streamed_output_logprobs(http: TestClient, router: StandInRouter) -> None:
    router.script = WITH_LOGPROBS
    events = _events(http.post("/v1/responses", json={
        "input": "x", "stream": True, "include": LOGPROBS, "top_logprobs": 2}))
    by_kind = {kind: data for kind, data in events}
    assert by_kind["response.content_part.added"]["part"]["logprobs"] == []
    deltas = [d for k, d in events if k == "response.output_text.delta"]
    # The held-back token rides with the delta that brings its text.
    assert [(d["delta"], d["logprobs"]) for d in deltas] == [
        ("Hel", [_streamed(HEL)]), ("lo", [_streamed(LO)]),
        ("\u20ac", [_streamed(HALF), _streamed(EURO)])]
    assert by_kind["response.output_text.done"]["logprobs"] == []  # vLLM's
    whole = [_entry(lp) for lp in (HEL, LO, HALF, EURO, END)]  # the end token's too
    assert by_kind["response.content_part.done"]["part"]["logprobs"] == whole
    assert by_kind["response.output_item.done"]["item"]["content"][0]["logprobs"] == whole
    final = by_kind["response.completed"]["response"]
    assert final["output"][0]["content"][0]["logprobs"] == whole
    assert final["top_logprobs"] == by_kind["response.created"]["response"]["top_logprobs"] == 2


def test_streamed_without_the_include_has_no_logprobs(http: TestClient,
                                                      router: StandInRouter) -> None:
    router.script = WITH_LOGPROBS
    events = _events(http.post("/v1/responses", json={"input": "x", "stream": True,
                                                      "top_logprobs": 2}))
    by_kind = {kind: data for kind, data in events}
    assert all(d["logprobs"] == [] for k, d in events if k == "response.output_text.delta")
    assert by_kind["response.content_part.done"]["part"]["logprobs"] is None
    assert by_kind["response.completed"]["response"]["output"][0]["content"][0][
        "logprobs"] is None


def test_streamed_calls_carry_no_logprobs(http_auto: TestClient, router: StandInRouter) -> None:
    """The message's tokens are listed; the call's are not (vLLM's)."""
    check, call, rest = (_lp("Checking.\n", -0.5, ("Checking.\n", -0.5)),
                         _lp("<tool_call>", -0.1), _lp("}", -0.2))
    router.script = [
        _delta_lp("Checking.\n", check),
        _delta_lp('<tool_call>\n{"name": "get_time", "arguments": ', call),
        _delta_lp('{"zone": 2}}\n</tool_call>', rest, finish=common_pb2.FINISH_REASON_STOP),
        _result(9, 3)]
    events = _events(http_auto.post("/v1/responses", json={
        "input": "x", "stream": True, "tools": TOOLS, "include": LOGPROBS, "top_logprobs": 1}))
    (delta,) = [d for k, d in events if k == "response.output_text.delta"]
    assert [lp["token"] for lp in delta["logprobs"]] == ["Checking.\n"]
    message, called = events[-1][1]["response"]["output"]
    assert [lp["token"] for lp in message["content"][0]["logprobs"]] == ["Checking.\n"]
    assert "logprobs" not in called


def test_the_openai_client_reads_output_logprobs(http: TestClient, router: StandInRouter) -> None:
    """The official client's types parse the logprobs, whole and streamed."""
    client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http,
                           max_retries=0)
    router.script = WITH_LOGPROBS
    whole = client.responses.create(model="m", input="x", include=LOGPROBS, top_logprobs=2)
    logprobs = whole.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert logprobs is not None and len(logprobs) == 5
    assert "".join(lp.token for lp in logprobs) == whole.output_text.replace(
        "\u20ac", "\ufffd\u20ac")
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)
    events = list(client.responses.create(model="m", input="x", include=LOGPROBS,
                                          top_logprobs=2, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in logprobs[:4]]
    assert all(len(lp.top_logprobs or []) == 2 for lp in streamed)
