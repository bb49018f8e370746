"""Malformed HTTP input against a real gateway, router and engine: every case is a 4xx in
OpenAI's error shape whose message names the field or the problem, never a 500, and the next
request on the same keep-alive connection succeeds (found by fuzzing a running mesh: values out
of a proto field's range, lone surrogates, invalid UTF-8, deep nesting, a wrong Content-Type).

One colocated engine behind a router and the gateway (`LocalMesh`), started once for the
module; one httpx client, so every case and the good request after it share a connection.
Beside the cases: vLLM's `prompt_logprobs` served, unknown fields ignored and named (as vLLM
ignores them), and an unexpected error in the gateway app (a JSON 500 on a connection that
stays open), the last two on the app alone under uvicorn.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi.responses import StreamingResponse

from pdmesh.gateway.app import create_app
from pdmesh.gateway.config import GatewayConfig
from pdmesh.serve import LocalMesh, MeshConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

KV_MEMORY = "96MiB"
GOOD = {"prompt": "Hi", "max_tokens": 1, "temperature": 0}
CHAT = [{"role": "user", "content": "hi"}]
UNCHECKED = object()
"""A case's `param` when the answer's `param` is not asserted (no single field is at fault)."""


@dataclass(frozen=True)
class Case:
    """One malformed request and what its answer must say."""

    name: str
    body: dict[str, Any] | bytes  # a dict goes as JSON (NaN/Infinity included), bytes as is
    says: str  # a substring of the error message naming the field or the problem
    param: object = UNCHECKED
    path: str = "/v1/completions"
    content_type: str | None = "application/json"
    headers: dict[str, bytes] = field(default_factory=dict)
    status: int = 400

    def send(self, http: httpx.Client) -> httpx.Response:
        content = self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()
        headers = dict(self.headers)
        if self.content_type is not None:
            headers["content-type"] = self.content_type.encode()
        return http.post(self.path, content=content, headers=headers)


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Hi", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": CHAT, "max_tokens": 2, **fields}


CASES = [
    # -- the body itself -----------------------------------------------------------------------
    Case("content-type text/plain", b'{"prompt": "Hi"}', "Content-Type 'text/plain'",
         "Content-Type", content_type="text/plain"),
    Case("no content-type", b'{"prompt": "Hi"}', "no Content-Type", "Content-Type",
         content_type=None),
    Case("form-encoded", b"prompt=Hi", "Only 'application/json' is allowed", "Content-Type",
         content_type="application/x-www-form-urlencoded"),
    Case("chat as text/plain", json.dumps(chat()).encode(), "Content-Type", "Content-Type",
         path="/v1/chat/completions", content_type="text/plain"),
    Case("invalid utf-8", b'{"prompt": "\xff\xfe"}', "not valid UTF-8: byte 0xff at offset 12",
         None),
    Case("utf-8 encoded surrogate", b'{"prompt": "\xed\xa0\x80"}', "not valid UTF-8", None),
    Case("truncated utf-8", b'{"prompt": "\xe2\x82"}', "not valid UTF-8", None),
    Case("10k-deep nesting", b"[" * 10_000 + b"]" * 10_000, "deeper than 200 levels", None),
    Case("deep nesting in a field", completion(guided_json=json.loads(
        '{"a":' * 300 + "1" + "}" * 300)), "deeper than 200 levels", None),
    Case("lone high surrogate in prompt", completion(prompt="\ud800"),
         "prompt: lone UTF-16 surrogate \\ud800", "prompt"),
    Case("lone low surrogate in chat", chat(messages=[{"role": "user", "content": "a\udc00"}]),
         "messages[0].content: lone UTF-16 surrogate", "messages[0].content",
         path="/v1/chat/completions"),
    Case("lone surrogate in stop", completion(stop=["ok", "\ud83d"]), "stop[1]: lone",
         "stop[1]"),
    Case("lone surrogate in a prompt list", completion(prompt=["a", "b\udfff"]),
         "prompt[1]: lone", "prompt[1]"),
    Case("lone surrogate in a key", completion(logit_bias={"\ud800": 1}),
         "a key of logit_bias: lone", "logit_bias"),
    Case("lone surrogate in tokenize", {"prompt": "\ud800"}, "prompt: lone", "prompt",
         path="/tokenize"),
    Case("truncated json", b'{"prompt": "Hi"', "not valid JSON: Expecting ',' delimiter", None),
    Case("trailing comma", b'{"prompt": "Hi",}', "not valid JSON", None),
    Case("trailing garbage", b'{"prompt": "Hi"} x', "not valid JSON: Extra data", None),
    Case("single quotes", b"{'prompt': 'Hi'}", "not valid JSON", None),
    Case("raw control character", b'{"prompt": "a\x01b"}', "not valid JSON", None),
    Case("empty body", b"", "the body is empty", None),
    Case("array body", b"[1, 2]", "must be a JSON object, got an array", None),
    Case("string body", b'"Hi"', "must be a JSON object, got a string", None),
    Case("null body", b"null", "must be a JSON object, got null", None),
    # -- integers out of the range of the proto field they travel in ---------------------------
    Case("max_tokens 2^70", completion(max_tokens=2**70), "max_tokens: Input should be less "
         "than or equal to 4294967295", "max_tokens"),
    Case("max_tokens 2^32", completion(max_tokens=2**32), "max_tokens", "max_tokens"),
    Case("max_tokens -1", completion(max_tokens=-1), "max_tokens", "max_tokens"),
    Case("max_tokens 0", completion(max_tokens=0), "max_tokens", "max_tokens"),
    Case("max_tokens past the context", completion(max_tokens=2**32 - 1), "do not fit",
         "max_tokens"),
    Case("stop_token_ids 10^12", completion(stop_token_ids=[10**12]), "stop_token_ids[0]",
         "stop_token_ids[0]"),
    Case("stop_token_ids -1", completion(stop_token_ids=[5, -1]), "stop_token_ids",
         "stop_token_ids"),
    Case("stop_token_ids past the vocabulary", completion(stop_token_ids=[2**31 - 1]),
         "out of range for vocab size", "stop_token_ids"),
    Case("prompt token 2^70", completion(prompt=[2**70]), "token id at prompt[0] must be in",
         "prompt"),
    Case("prompt token -2^31-1", completion(prompt=[[1, 2], [3, -(2**31) - 1]]),
         "prompt[1][1]", "prompt"),
    Case("prompt token -1", completion(prompt=[1, -1]), "token id -1 is outside", "prompt"),
    Case("prompt token past the vocabulary", completion(prompt=[60000]),
         "token id 60000 is outside", "prompt"),
    Case("seed 2^64", completion(seed=2**64), "seed", "seed"),
    Case("seed -2^63-1", completion(seed=-(2**63) - 1), "seed", "seed"),
    Case("top_k 2^40", completion(top_k=2**40), "top_k", "top_k"),
    Case("top_k -2", completion(top_k=-2), "top_k must be >= -1", "top_k"),
    Case("priority 2^31", completion(priority=2**31), "priority", "priority"),
    Case("logit_bias key 2^40", completion(logit_bias={str(2**40): 1}),
         "the token id '1099511627776' must be in", "logit_bias"),
    Case("logit_bias key not a number", completion(logit_bias={"abc": 1}),
         "keys must be token ids", "logit_bias"),
    Case("logit_bias key superscript digit", completion(logit_bias={"\u00b2": 1}),
         "keys must be token ids", "logit_bias"),
    Case("logit_bias value 1000", completion(logit_bias={"5": 1000}),
         "logit_bias values must be in [-100, 100]", "logit_bias"),
    Case("logprobs 2^70", completion(logprobs=2**70), "logprobs", "logprobs"),
    Case("logprobs 21", completion(logprobs=21),
         "Requested sample logprobs of 21, which is greater than max allowed: 20", "logprobs"),
    Case("n 0", completion(n=0), "n: Input should be greater than or equal to 1", "n"),
    Case("n 2^70", completion(n=2**70), "n", "n"),
    Case("min_tokens 2^40", completion(min_tokens=2**40), "min_tokens", "min_tokens"),
    Case("min_tokens -1", completion(min_tokens=-1), "min_tokens", "min_tokens"),
    Case("min_tokens over max_tokens", completion(min_tokens=5), "min_tokens must be <= "
         "max_tokens", "min_tokens"),
    Case("stream_interval 0", completion(stream_interval=0), "stream_interval",
         "stream_interval"),
    Case("stream_interval 2^33", completion(stream_interval=2**33), "stream_interval",
         "stream_interval"),
    Case("prompt_logprobs 2^40", completion(prompt_logprobs=2**40), "prompt_logprobs",
         "prompt_logprobs"),
    Case("prompt_logprobs 21", completion(prompt_logprobs=21),
         "Requested prompt logprobs of 21, which is greater than max allowed: 20",
         "prompt_logprobs"),
    Case("prompt_logprobs -1", completion(prompt_logprobs=-1),
         "prompt_logprobs must be in [0, 20], got -1", "prompt_logprobs"),
    Case("prompt_logprobs streamed", completion(prompt_logprobs=2, stream=True),
         "`prompt_logprobs` are not available when `stream=True`", "prompt_logprobs"),
    Case("chat top_logprobs 2^40", chat(logprobs=True, top_logprobs=2**40), "top_logprobs",
         "top_logprobs", path="/v1/chat/completions"),
    Case("chat max_completion_tokens 2^70", chat(max_completion_tokens=2**70),
         "max_completion_tokens", "max_completion_tokens", path="/v1/chat/completions"),
    Case("chat prompt_logprobs 2^40", chat(prompt_logprobs=2**40), "prompt_logprobs",
         "prompt_logprobs", path="/v1/chat/completions"),
    Case("detokenize token 2^40", {"tokens": [1, 2**40]}, "tokens[1]", "tokens[1]",
         path="/detokenize"),
    Case("detokenize token -1", {"tokens": [-1]}, "token id -1 is outside", "tokens",
         path="/detokenize"),
    # -- floats ----------------------------------------------------------------------------------
    Case("temperature -1", completion(temperature=-1), "temperature must be >= 0",
         "temperature"),
    Case("temperature 1e400", b'{"prompt": "Hi", "temperature": 1e400}',
         "temperature must be >= 0 and finite, got inf", "temperature"),
    Case("temperature NaN", completion(temperature=float("nan")), "temperature must not be NaN",
         "temperature"),
    Case("top_p 0", completion(top_p=0), "top_p must be in (0, 1]", "top_p"),
    Case("top_p 2", completion(top_p=2), "top_p must be in (0, 1]", "top_p"),
    Case("min_p 1.5", completion(min_p=1.5), "min_p must be in [0, 1]", "min_p"),
    Case("presence_penalty 5", completion(presence_penalty=5), "presence_penalty must be in",
         "presence_penalty"),
    Case("frequency_penalty -Infinity", completion(frequency_penalty=float("-inf")),
         "frequency_penalty must be in", "frequency_penalty"),
    Case("repetition_penalty 0", completion(repetition_penalty=0),
         "repetition_penalty must be > 0", "repetition_penalty"),
    # -- types and shapes ------------------------------------------------------------------------
    Case("max_tokens a string", completion(max_tokens="many"), "max_tokens: Input should be a "
         "valid integer", "max_tokens"),
    Case("max_tokens a fraction", completion(max_tokens=2.5), "max_tokens", "max_tokens"),
    Case("prompt a number", completion(prompt=5), "prompt", "prompt"),
    Case("prompt an object", completion(prompt={}), "prompt", "prompt"),
    Case("prompt empty list", completion(prompt=[]), "prompt must not be an empty list",
         "prompt"),
    Case("prompt missing", {"max_tokens": 2}, "prompt: Field required", "prompt"),
    Case("prompt empty", completion(prompt=""), "the prompt is empty", "prompt"),
    Case("stop empty string", completion(stop=[""]), "stop strings must be non-empty", "stop"),
    Case("stop a number", completion(stop=5), "stop", "stop"),
    Case("echo a word", completion(echo="sometimes"), "echo", "echo"),
    Case("stream_options without stream", completion(stream_options={"include_usage": True}),
         "stream_options is only allowed when stream is true", None),
    Case("model a number", completion(model=5), "model: Input should be a valid string",
         "model"),
    Case("unknown model", completion(model="gpt-none"), "is not served here", "model",
         status=404),
    Case("chat messages empty", chat(messages=[]), "messages", "messages",
         path="/v1/chat/completions"),
    Case("chat messages missing", {"max_tokens": 2}, "messages: Field required", "messages",
         path="/v1/chat/completions"),
    Case("chat role a number", chat(messages=[{"role": 5, "content": "x"}]), "messages[0].role",
         "messages[0].role", path="/v1/chat/completions"),
    Case("chat unknown role", chat(messages=[{"role": "wizard", "content": "x"}]),
         "unknown role 'wizard'", "messages[0].role", path="/v1/chat/completions"),
    Case("chat content part of unknown type",
         chat(messages=[{"role": "user", "content": [{"type": "video", "text": "x"}]}]),
         "messages[0].content", UNCHECKED, path="/v1/chat/completions"),
    Case("chat top_logprobs without logprobs", chat(top_logprobs=2),
         "top_logprobs requires logprobs", None, path="/v1/chat/completions"),
    Case("chat tool name with spaces", chat(tools=[{"type": "function", "function": {
        "name": "no spaces allowed"}}]), "tools[0].function.name", "tools[0].function.name",
         path="/v1/chat/completions"),
    Case("regex that does not compile", completion(guided_regex="(ab"), "does not compile",
         "guided_regex"),
    Case("two structured outputs", completion(guided_regex="a", guided_choice=["a"]),
         "at most one structured output", None),
    Case("tokenize neither prompt nor messages", {"add_special_tokens": True},
         "give exactly one of prompt and messages", None, path="/tokenize"),
    # -- headers ---------------------------------------------------------------------------------
    Case("x-request-id not ASCII", completion(), "X-Request-Id must be printable ASCII",
         "X-Request-Id", headers={"x-request-id": "caf\u00e9".encode("latin-1")}),
    Case("x-request-id too long", completion(), "X-Request-Id", "X-Request-Id",
         headers={"x-request-id": b"r" * 200}),
]


@pytest.fixture(scope="module")
def mesh() -> Iterator[str]:
    """The gateway's base URL."""
    config = MeshConfig(colocated=True, num_decode=1, port=0, kv_cache_memory=KV_MEMORY)
    with LocalMesh(config) as local:
        assert local.gateway is not None and local.gateway.address is not None
        yield f"http://{local.gateway.address}"


@pytest.fixture(scope="module")
def http(mesh: str) -> Iterator[httpx.Client]:
    """One keep-alive connection for the whole module."""
    with httpx.Client(base_url=mesh, timeout=60,
                      limits=httpx.Limits(max_connections=1)) as client:
        yield client


def test_the_cases_are_many_and_distinct() -> None:
    assert len(CASES) >= 60
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_malformed_input_is_refused_and_the_connection_stays_usable(
    http: httpx.Client, case: Case
) -> None:
    refused = case.send(http)
    assert refused.status_code == case.status, refused.text
    error = refused.json()["error"]
    assert list(error) == ["message", "type", "param", "code"], error  # vLLM's ErrorInfo
    assert error["code"] == case.status, error
    # vLLM's types: "Bad Request" for a body its request validation refuses, else its class.
    assert error["type"] in ({"Bad Request", "BadRequestError"} if case.status == 400
                             else {"NotFoundError"}), error
    assert "sampling." not in error["message"], error  # no router field paths
    assert case.says in error["message"], error
    if case.param is not UNCHECKED:
        assert error["param"] == case.param, error
    connection = refused.extensions["network_stream"]

    answered = http.post("/v1/completions", json=GOOD)
    assert answered.status_code == 200, answered.text
    assert answered.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert answered.extensions["network_stream"] is connection, "the connection was closed"


def test_prompt_logprobs_are_served(http: httpx.Client) -> None:
    """vLLM's `prompt_logprobs`: per prompt token, its logprob and the k most likely tokens',
    the same numbers completions' `echo` with `logprobs` shows for the prompt."""
    prompt = "The capital of France is"
    got = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "n": 2,
                                             "temperature": 0, "prompt_logprobs": 2})
    assert got.status_code == 200, got.text
    choices = got.json()["choices"]
    plp = choices[0]["prompt_logprobs"]
    assert choices[1]["prompt_logprobs"] == plp  # the same prompt for every choice
    num_tokens = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    assert plp[0] is None and len(plp) == num_tokens
    echo = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "echo": True,
                                              "logprobs": 2, "temperature": 0}).json()
    shown = echo["choices"][0]["logprobs"]
    for position in range(1, num_tokens):
        entry = plp[position]
        assert len(entry) in (2, 3)  # the top 2 and the prompt's token (may be one of them)
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]
        by_text = {e["decoded_token"]: e["logprob"] for e in entry.values()}
        assert by_text == pytest.approx(shown["top_logprobs"][position], abs=1e-5)
        assert by_text[shown["tokens"][position]] == pytest.approx(
            shown["token_logprobs"][position], abs=1e-5)

    chat_answer = http.post("/v1/chat/completions", json=chat(prompt_logprobs=0)).json()
    chat_plp = chat_answer["prompt_logprobs"]
    assert chat_plp[0] is None and len(chat_plp) == chat_answer["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in chat_plp[1:])  # k = 0: the prompt's token only
    assert "prompt_logprobs" not in chat_answer["choices"][0]


def test_unknown_fields_are_ignored_and_named_in_a_header(http: httpx.Client) -> None:
    """As vLLM: fields its request models have and pdmesh does not act on, and fields no one
    knows, are ignored; the answer's X-Ignored-Fields names them (client-chosen names made
    printable ASCII)."""
    vllm_only = {"store": False, "metadata": {"k": "v"}, "service_tier": "auto",
                 "kv_transfer_params": {"do_remote_decode": False}}
    answer = http.post("/v1/chat/completions", json=chat(
        **vllm_only, **{"caf\u00e9\n": 1},
        messages=[{"role": "user", "content": "hi", "refusal": None}]))
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-ignored-fields"] == (
        "store, metadata, service_tier, kv_transfer_params, "
        "caf\\xe9\\n, messages[0].refusal")
    plain = http.post("/v1/completions", json=GOOD)
    assert "x-ignored-fields" not in plain.headers
    tokenized = http.post("/tokenize", json={"prompt": "hi", "return_tokens_as_token_ids": 1})
    assert tokenized.status_code == 200
    assert tokenized.headers["x-ignored-fields"] == "return_tokens_as_token_ids"


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """`app` under uvicorn on a free port of this host (as `pdmesh gateway` runs it); yields
    its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


def no_router_app() -> Any:
    """The gateway app with nowhere to send requests (only what it answers itself works)."""
    return create_app(GatewayConfig(router_address="127.0.0.1:9", control_timeout_s=1))


def test_an_unexpected_error_is_a_json_500_and_the_connection_stays_usable() -> None:
    """The gateway app on a real socket, with two routes that fail as no route should: before
    answering (a JSON 500, the connection kept) and mid-stream (the answer cannot be
    completed, so the connection closes)."""
    app = no_router_app()

    @app.get("/fails")
    async def fails() -> None:
        raise RuntimeError("a bug")

    @app.get("/fails-mid-stream")
    async def fails_mid_stream() -> StreamingResponse:
        async def chunks() -> AsyncIterator[str]:
            yield "data: one\n\n"
            raise RuntimeError("a bug mid-stream")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def run() -> None:
        async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=10) as http:
            failed = await http.get("/fails")
            assert failed.status_code == 500
            assert failed.json()["error"] == {
                "message": "internal error: RuntimeError: a bug",
                "type": "InternalServerError", "param": None, "code": 500}
            version = await http.get("/version")
            assert version.status_code == 200
            assert version.extensions["network_stream"] is failed.extensions["network_stream"]

            with pytest.raises(httpx.RemoteProtocolError):
                await http.get("/fails-mid-stream")
            assert (await http.get("/version")).status_code == 200  # on a new connection

    asyncio.run(run())


def test_ignored_fields_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> httpx.Response:
        async with serving(no_router_app()) as base, httpx.AsyncClient(base_url=base) as http:
            return await http.post("/tokenize", json={"prompt": "x", "bogus": 1, "store": 0},
                                   headers={"x-request-id": "ignoring-1"})

    with caplog.at_level(logging.WARNING, logger="pdmesh.gateway.ignored_fields"):
        answer = asyncio.run(run())
    assert answer.status_code == 503  # no router; the body was read all the same
    assert answer.headers["x-ignored-fields"] == "bogus, store"
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert lines == ["request_id=ignoring-1 ignored unknown fields: bogus, store"]
