"""`--reasoning-parser`: a thinking model's output split into `reasoning` and content, whole and
streamed alike, tool calls read from the content only, per request as its template variables
say it thinks; its structured output told to start after the thinking; and the split through
the gateway's routes (chat, /v1/responses) against a stand-in router."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pdmesh.config import parse_config
from pdmesh.gateway.app import create_app
from pdmesh.gateway.chat_schemas import ChatCompletionRequest
from pdmesh.gateway.config import GatewayConfig
from pdmesh.gateway.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from pdmesh.gateway.reply import ReasoningSettings, ReplyPlan, read_reply
from pdmesh.gateway.tools import ToolSettings
from pdmesh.gateway.translate import chat_plan
from pdmesh.router.config import RouterConfig
from pdmesh.serve import MeshConfig
from pdmesh.serve.child_config import child_config, gateway_placement, router_placement
from pdmesh.v1 import common_pb2, router_pb2
from tests.unit.test_gateway_responses import StandInRouter, _delta, _result

pytestmark = pytest.mark.fast

R1 = REASONING_PARSERS["deepseek_r1"]
QWEN3 = ReasoningSettings("qwen3")
THOUGHT = "<think>The user greets me.\nI greet back.</think>\n\nHello!"


def split_reasoning(parser: ReasoningParser, pieces: Iterable[str]) -> tuple[str | None, str]:
    """An output fed to the parser's stream piece by piece: (reasoning or None, content)."""
    stream = parser.stream()
    reasoning = content = ""
    for split in [*(stream.feed(p) for p in pieces), stream.finish()]:
        reasoning += split.reasoning
        content += split.content
    return reasoning or None, content


def chunkings(text: str) -> Iterator[list[str]]:
    """The whole text, one character at a time, and cut at every position in two."""
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    (THOUGHT, "The user greets me.\nI greet back.", "\n\nHello!"),
    ("No start tag, the template opened it.</think>Answer", "No start tag, the template "
     "opened it.", "Answer"),
    ("<think>cut by max_tokens", "cut by max_tokens", ""),
    ("</think>at once", None, "at once"),
    ("<think></think>", None, ""),
    ("a < b, and </thin is not the tag</think>x", "a < b, and </thin is not the tag", "x"),
])
def test_split_is_the_same_whatever_the_chunking(text: str, reasoning: str | None,
                                                 content: str) -> None:
    for pieces in chunkings(text):
        assert split_reasoning(R1, pieces) == (reasoning, content), pieces


def test_whether_a_request_thinks_follows_its_template_variables() -> None:
    assert REASONING_PARSERS["deepseek_r1"].thinks({"enable_thinking": False})
    qwen3, v3 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_v3"]
    assert qwen3.thinks({}) and not qwen3.thinks({"enable_thinking": False})
    assert not v3.thinks({}) and v3.thinks({"thinking": True})
    server_off = ReasoningSettings("qwen3", {"enable_thinking": False})
    assert server_off.parser_for(None) is None
    assert server_off.parser_for({"enable_thinking": True}) is qwen3  # the request's wins
    assert ReasoningSettings().parser_for({}) is None


HERMES_AFTER_THOUGHT = ('<think>Maybe <tool_call>{"name": "nope", "arguments": {}}</tool_call>'
                        '? No: the time.</think>\n<tool_call>\n{"name": "get_time", '
                        '"arguments": {"zone": 2}}\n</tool_call>')


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def test_tool_calls_are_read_from_the_content_only() -> None:
    plan = chat_plan(_chat(tools=[TOOL]), "r", ToolSettings(True, "hermes"),
                     reasoning=QWEN3).formatter.reply  # type: ignore[attr-defined]
    for pieces in chunkings(HERMES_AFTER_THOUGHT):
        stream = plan.stream()
        assert stream is not None
        read = read_reply(stream, pieces, has_reasoning=True)
        assert read.reasoning is not None and "nope" in read.reasoning, pieces
        assert read.content is None
        assert [(c.name, json.loads(c.arguments)) for c in read.tool_calls] == [
            ("get_time", {"zone": 2})]


def test_include_reasoning_false_drops_it() -> None:
    read = ReplyPlan(None, R1, include_reasoning=False).read(THOUGHT)
    assert (read.reasoning, read.content) == (None, "\n\nHello!")


def test_a_thinking_request_s_structured_output_starts_after_the_thinking() -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}

    def sent(**fields: Any) -> common_pb2.StructuredOutput:
        plan = chat_plan(_chat(response_format=schema, **fields), "r", ToolSettings(),
                         reasoning=QWEN3)
        return plan.requests[0].sampling.structured_output

    assert sent().reasoning_end == "</think>"
    assert sent(chat_template_kwargs={"enable_thinking": False}).reasoning_end == ""
    named = chat_plan(_chat(tools=[TOOL], tool_choice={"type": "function", "function": {
        "name": "get_time"}}), "r", ToolSettings(), reasoning=QWEN3)
    assert named.requests[0].sampling.structured_output.reasoning_end == "</think>"
    plain = chat_plan(_chat(), "r", ToolSettings(), reasoning=QWEN3)
    assert not plain.requests[0].sampling.HasField("structured_output")


def test_flags_are_checked_at_start_and_reach_the_gateway() -> None:
    with pytest.raises(ValueError, match="--reasoning-parser must be one of deepseek_r1"):
        GatewayConfig(reasoning_parser="nope")
    with pytest.raises(ValueError, match="--default-chat-template-kwargs: not valid JSON"):
        GatewayConfig(default_chat_template_kwargs="{")
    mesh = parse_config(MeshConfig, [
        "--model", "smollm2", "--reasoning-parser", "qwen3",
        "--default-chat-template-kwargs", '{"enable_thinking": false}'], prog="serve", env={})
    gateway = child_config(GatewayConfig, mesh, gateway_placement(
        mesh, router_address="127.0.0.1:1", port=0))
    router = child_config(RouterConfig, mesh, router_placement(
        mesh, redis_url="redis://127.0.0.1:1", port=0, metrics_port=0, prefill=[], decode=[]))
    assert gateway.reasoning_settings == ReasoningSettings("qwen3", {"enable_thinking": False})
    assert router.template_defaults == {"enable_thinking": False}


# -- through the routes ---------------------------------------------------------------------------
THINKING = [_delta("<think>"), _delta("Greet"), _delta("ing.</th"), _delta("ink>\n\nHel"),
            _delta("lo!", common_pb2.FINISH_REASON_STOP), _result(9, 5)]


@pytest.fixture(name="router")
def router_fixture() -> StandInRouter:
    router = StandInRouter()
    router.script = THINKING
    return router


@pytest.fixture(name="http")
def http_fixture(router: StandInRouter) -> Iterator[TestClient]:
    """The gateway as `--reasoning-parser qwen3` starts it."""
    with TestClient(create_app(GatewayConfig(reasoning_parser="qwen3"),
                               client=router)) as http:  # type: ignore[arg-type]
        yield http


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _events(body: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in body.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_chat_answers_reasoning_whole_and_streamed(http: TestClient) -> None:
    whole = http.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
    assert (whole["reasoning"], whole["content"]) == ("Greeting.", "\n\nHello!")
    chunks = _events(http.post("/v1/chat/completions", json={**CHAT, "stream": True}).text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == "Greeting."
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nHello!"
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning" not in d for d in deltas[first_content:])
    off = http.post("/v1/chat/completions", json={
        **CHAT, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert off["choices"][0]["message"] == {
        "role": "assistant", "content": "<think>Greeting.</think>\n\nHello!", "reasoning": None,
        "tool_calls": []}
    hidden = http.post("/v1/chat/completions", json={**CHAT, "include_reasoning": False}).json()
    assert hidden["choices"][0]["message"]["reasoning"] is None


def test_responses_answer_a_reasoning_item_whole_and_streamed(http: TestClient) -> None:
    whole = http.post("/v1/responses", json={"model": "m", "input": "hi"}).json()
    reasoning, message = whole["output"]
    assert (reasoning["type"], reasoning["id"]) == ("reasoning", message["id"].replace(
        "msg_", "rs_"))
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Greeting."}]
    assert message["content"][0]["text"] == "\n\nHello!"
    body = http.post("/v1/responses", json={"model": "m", "input": "hi", "stream": True}).text
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:5] == ["response.output_item.added", "response.reasoning_part.added",
                          "response.reasoning_text.delta"]
    done = kinds.index("response.reasoning_text.done")
    assert kinds[done:done + 5] == [
        "response.reasoning_text.done", "response.reasoning_part.done",
        "response.output_item.done", "response.output_item.added",
        "response.content_part.added"]
    assert "".join(e["delta"] for e in events
                   if e["type"] == "response.reasoning_text.delta") == "Greeting."
    assert "".join(e["delta"] for e in events
                   if e["type"] == "response.output_text.delta") == "\n\nHello!"
    completed = events[-1]
    assert completed["type"] == "response.completed"
    assert [i["type"] for i in completed["response"]["output"]] == ["reasoning", "message"]
    def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in item.items() if k != "id"} for item in items]

    assert without_ids(completed["response"]["output"]) == without_ids(whole["output"])


def test_a_router_request_carries_no_reasoning_end_without_a_parser() -> None:
    schema = {"type": "json_object"}
    plan = chat_plan(_chat(response_format=schema), "r", ToolSettings())
    request: router_pb2.GenerateRequest = plan.requests[0]
    assert request.sampling.structured_output.json_object
    assert request.sampling.structured_output.reasoning_end == ""


def test_a_named_call_is_announced_after_the_thinking() -> None:
    named = chat_plan(_chat(tools=[TOOL], tool_choice={"type": "function", "function": {
        "name": "get_time"}}), "r", ToolSettings(), reasoning=QWEN3).formatter
    stream = named.reply.stream()  # type: ignore[attr-defined]
    thinking = stream.feed("<think>The zone is 2")
    assert thinking.reasoning == "The zone is 2" and not thinking.tool_calls
    answer = stream.feed('</think>{"zone": 2}')
    assert [d.name for d in answer.tool_calls if d.id] == ["get_time"]
    assert "".join(d.arguments for d in answer.tool_calls) == '{"zone": 2}'


QWEN35_CALL = ("<think>I will ask for the time.\n<tool_call>\n<function=get_time>\n"
               "<parameter=zone>\n2\n</parameter>\n</function>\n</tool_call>")


def test_qwen3_an_xml_call_inside_the_thinking_ends_it() -> None:
    """Qwen3.5 opens `<tool_call><function=…>` without closing its thinking: the call is
    content, read by qwen3_coder, whatever the chunking; a `<tool_call>` that no `<function`
    follows is still thinking."""
    plan = chat_plan(_chat(tools=[TOOL]), "r", ToolSettings(True, "qwen3_coder"),
                     reasoning=QWEN3).formatter.reply  # type: ignore[attr-defined]
    for pieces in chunkings(QWEN35_CALL):
        stream = plan.stream()
        assert stream is not None
        read = read_reply(stream, pieces, has_reasoning=True)
        assert read.reasoning == "I will ask for the time.\n", pieces
        assert read.content is None
        assert [(c.name, json.loads(c.arguments)) for c in read.tool_calls] == [
            ("get_time", {"zone": "2"})]  # TOOL's schema types no `zone`: a string
    mention = "<think>The <tool_call> tag, then </think>ok"
    for pieces in chunkings(mention):
        assert split_reasoning(REASONING_PARSERS["qwen3"], pieces) == (
            "The <tool_call> tag, then ", "ok"), pieces
    assert split_reasoning(R1, [QWEN35_CALL])[1] == ""  # deepseek_r1 has no implicit end


# -- reasoning sent back in the history -----------------------------------------------------------
def test_an_assistant_s_reasoning_travels_to_the_router() -> None:
    """(tests/unit/test_chat_template_tools.py renders it.)"""
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "Hello!", "reasoning": "Greet back."},
               {"role": "user", "content": "and?"}]
    request = _chat(messages=history).to_generate("r")
    assert [m.reasoning for m in request.chat.messages] == ["", "Greet back.", ""]
    old_name = _chat(messages=[{"role": "assistant", "content": "x",
                                "reasoning_content": "y"}]).to_generate("r")
    assert old_name.chat.messages[0].reasoning == "y"  # vLLM's older field name
    with pytest.raises(ValueError, match="reasoning is only allowed on assistant messages"):
        _chat(messages=[{"role": "user", "content": "x", "reasoning": "y"}])


def test_a_responses_output_sent_back_as_input_keeps_its_reasoning(
        router: StandInRouter) -> None:
    """An agent's loop: the response's output items (reasoning, a call) go back as input with
    the call's result; the reasoning opens the assistant turn that made the call."""
    config = GatewayConfig(reasoning_parser="qwen3", enable_auto_tool_choice=True,
                           tool_call_parser="hermes")
    with TestClient(create_app(config, client=router)) as http:  # type: ignore[arg-type]
        calls = [_delta('<think>Need the time.</think>\n<tool_call>\n{"name": "get_time", '
                        '"arguments": {}}\n</tool_call>', common_pb2.FINISH_REASON_STOP),
                 _result(9, 5)]
        router.script = calls
        tools = [{"type": "function", "name": "get_time", "parameters": {"type": "object"}}]
        first = http.post("/v1/responses", json={"model": "m", "input": "time?", "tools": tools})
        assert first.status_code == 200, first.text
        output = first.json()["output"]
        assert [item["type"] for item in output] == ["reasoning", "function_call"]
        router.script = THINKING
        again = http.post("/v1/responses", json={"model": "m", "tools": tools, "input": [
            {"role": "user", "content": "time?"}, *output,
            {"type": "function_call_output", "call_id": output[1]["call_id"], "output": "noon"}]})
        assert again.status_code == 200, again.text
        messages = router.requests[-1].chat.messages
        assert [(m.role, m.reasoning, [c.name for c in m.tool_calls]) for m in messages] == [
            ("user", "", []), ("assistant", "Need the time.", ["get_time"]), ("tool", "", [])]


def test_reasoning_effort_is_the_template_s_variable() -> None:
    """vLLM's: chat's `reasoning_effort` and /v1/responses' `reasoning.effort` reach the
    template as `reasoning_effort`; the request's own chat_template_kwargs win."""
    from pdmesh.gateway.responses_schemas import ResponsesRequest

    def kwargs(request: router_pb2.GenerateRequest) -> dict[str, Any]:
        text = request.chat.chat_template_kwargs_json
        return json.loads(text) if text else {}

    assert kwargs(_chat(reasoning_effort="low").to_generate("r")) == {"reasoning_effort": "low"}
    assert kwargs(_chat(reasoning_effort="low", chat_template_kwargs={
        "reasoning_effort": "high", "x": 1}).to_generate("r")) == {
        "reasoning_effort": "high", "x": 1}
    assert kwargs(_chat().to_generate("r")) == {}
    responses = ResponsesRequest.model_validate(
        {"input": "hi", "reasoning": {"effort": "medium", "summary": "auto"}})
    assert kwargs(responses.to_chat().to_generate("r")) == {"reasoning_effort": "medium"}
    with pytest.raises(ValueError, match="reasoning_effort"):
        _chat(reasoning_effort="extreme")
