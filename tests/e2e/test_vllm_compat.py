"""What a vLLM user expects from `pdmesh serve`, checked with the official `openai` client.

Two meshes, each started as a user starts `vllm serve` (the model positional, `--port` the HTTP
port), with a `--generation-config` directory whose generation_config.json sets non-default
sampling (greedy, 5 new tokens) so the server defaults are visible in the answers:

* colocated, the model given by its alias;
* 1 prefill + 1 decode (local prefill off: KV really moves), the model given by its directory
  and the rest in a vLLM `--config` YAML file (`--served-model-name` with two names and
  `--max-model-len`, which `/v1/models` must show; the same sampling defaults from
  `--generation-config vllm` with `--override-generation-config`; a `port` the command line's
  `--port` overrides; `--reasoning-parser qwen3` with thinking off by default;
  `--sse-keep-alive-interval`, so every stream of that mesh starts at acceptance and may carry
  keep-alive comments, which the `openai` client skips).

Covered: server sampling defaults and their override by the request (also on the router's gRPC
API), `/tokenize` -> `/detokenize`, `/version`, completions `echo`, `X-Request-Id`, CORS
preflight and `continuous_usage_stats`.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from pdmesh.serve import Child, pdmesh_command
from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

KV_MEMORY = "96MiB"
ORIGIN = "http://app.example"
SERVED_NAME = "my-smol"
ALIAS = "gpt-3.5-turbo"  # a second served name (vLLM's --served-model-name takes several)
MAX_MODEL_LEN = 1024
DEFAULT_NEW_TOKENS = 5  # the generation config's max_new_tokens
PROMPT = "Count from one to twenty: one, two, three,"


@dataclass
class Mesh:
    kind: str
    router: str
    base_url: str  # http://host:port
    model: str
    serve: Child


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def generation_config_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """A copy of the model's generation_config.json with non-default sampling in it."""
    path = tmp_path_factory.mktemp("genconfig")
    config = json.loads((model_dir / "generation_config.json").read_text())
    config.update(temperature=0.0, max_new_tokens=DEFAULT_NEW_TOKENS)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


SERVER_YAML = f"""\
port: 1  # the command line's --port wins
kv-cache-memory: {KV_MEMORY}
allowed-origins: [{ORIGIN}]
num-prefill: 1
num-decode: 1
local-prefill-threshold: 0
served-model-name: [{SERVED_NAME}, {ALIAS}]
max_model_len: {MAX_MODEL_LEN}
# no generation_config.json: the override alone gives the defaults
generation-config: vllm
override-generation-config: {{temperature: 0.0, max_new_tokens: {DEFAULT_NEW_TOKENS}}}
# vLLM flags that ask for what pdmesh does anyway, and one it maps
disable-log-stats: true
kv-cache-dtype: auto
tokenizer-mode: auto
disable-fastapi-docs: true
enable-server-load-tracking: true
# an SSE comment whenever a stream idles 50 ms (the streams start at acceptance)
sse-keep-alive-interval: 0.05
# Qwen3's reasoning parser, with thinking off unless a request turns it on
reasoning-parser: qwen3
default-chat-template-kwargs: {{enable_thinking: false}}
# vLLM's request log, its outputs cut to 8 characters
enable-log-requests: true
enable-log-outputs: true
max-log-len: 8
"""


@pytest.fixture(scope="module", params=["colocated", "1p1d"])
def mesh(request: pytest.FixtureRequest, generation_config_dir: Path, model_dir: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    port = _free_port()
    common = ["--port", str(port), "--kv-cache-memory", KV_MEMORY,
              "--generation-config", str(generation_config_dir), "--allowed-origins", ORIGIN]
    if request.param == "colocated":
        argv, model = ["smollm2", *common, "--colocated"], "smollm2"
    else:  # set up as a vLLM deployment keeps it: a --config file under the command line
        config = tmp_path_factory.mktemp("serve") / "server.yaml"
        config.write_text(SERVER_YAML)
        argv = [str(model_dir), "--port", str(port), "--config", str(config)]
        model = SERVED_NAME
    serve = Child("serve", pdmesh_command("serve", *argv))
    try:
        router = serve.wait_ready(timeout_s=240)
        yield Mesh(request.param, router, f"http://127.0.0.1:{port}", model, serve)
    finally:
        serve.terminate(grace_s=30)


@pytest.fixture()
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_serve_takes_vllm_flags(mesh: Mesh, client: openai.OpenAI) -> None:
    """`pdmesh serve MODEL --port P [--served-model-name X --max-model-len N]`: the OpenAI API
    is on P and lists the model under its served name, with its context limit."""
    models = httpx.get(f"{mesh.base_url}/v1/models", timeout=10).json()["data"]
    if mesh.kind == "1p1d":  # vLLM's several served names: each one listed and answered
        assert [m["id"] for m in models] == [mesh.model, ALIAS]
        assert [m["max_model_len"] for m in models] == [MAX_MODEL_LEN] * 2
        by_alias = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=2)
        assert by_alias.model == ALIAS and by_alias.choices[0].text
    else:
        assert [m["id"] for m in models] == [mesh.model]
    version = httpx.get(f"{mesh.base_url}/version", timeout=10)
    assert version.status_code == 200 and version.json()["version"]
    docs = httpx.get(f"{mesh.base_url}/docs", timeout=10)
    assert docs.status_code == (404 if mesh.kind == "1p1d" else 200)  # --disable-fastapi-docs


def test_requests_and_outputs_are_logged_when_asked(mesh: Mesh,
                                                    client: openai.OpenAI) -> None:
    """`--enable-log-requests --enable-log-outputs --max-log-len 8` (the 1P+1D mesh's file):
    the router logs the request as admitted and its output, cut, as it ends."""
    if mesh.kind != "1p1d":
        return  # the colocated mesh did not ask (off by default: tests/unit/test_request_log.py)
    request_id = "log-me-1"
    answer = client.completions.create(model=mesh.model, prompt=PROMPT, max_tokens=12,
                                       extra_headers={"X-Request-Id": request_id})
    text = answer.choices[0].text
    lines = stderr_lines_until(mesh.serve, f"msg=finished request_id={request_id} ")
    received, finished = [line for line in lines if f"request_id={request_id} " in line]
    assert "msg=received" in received and "prompt_tokens=" in received
    assert "max_tokens: 12" in received
    assert "finish_reason=length output_tokens=12" in finished
    assert f"output={text[:8] + '...'!r}" in finished


def test_load_counts_the_requests_in_flight(mesh: Mesh, client: openai.OpenAI) -> None:
    """vLLM's /load: 1 while a streamed completion is open, 0 once it has ended."""
    def server_load() -> int:
        return int(httpx.get(f"{mesh.base_url}/load", timeout=10).json()["server_load"])

    assert server_load() == 0
    stream = client.completions.create(model=mesh.model, prompt=PROMPT, max_tokens=8,
                                       stream=True)
    next(iter(stream))
    assert server_load() == 1
    for _ in stream:
        pass
    deadline = time.monotonic() + 10  # the count drops as the server closes its side
    while server_load() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server_load() == 0


def stderr_lines_until(child: Child, text: str, timeout_s: float = 30) -> list[str]:
    """The child's last stderr lines once one holds `text` (its relay thread passes them on
    as the child writes them); AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = list(child.stderr_tail)
        if any(text in line for line in lines):
            return lines
        time.sleep(0.05)
    raise AssertionError(f"no stderr line with {text!r}: {list(child.stderr_tail)}")


def test_generation_config_defaults_and_request_override(mesh: Mesh,
                                                         client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    # Server defaults: greedy (three samples agree) and max_new_tokens as default max_tokens.
    chat = client.chat.completions.create(model=mesh.model, messages=messages, n=3)
    assert chat.usage is not None and chat.usage.completion_tokens == 3 * DEFAULT_NEW_TOKENS
    assert len({c.message.content for c in chat.choices}) == 1
    # The request wins: its own max_tokens and temperature.
    chat = client.chat.completions.create(model=mesh.model, messages=messages, n=3,
                                          max_tokens=12, temperature=1.5, seed=7)
    assert chat.usage is not None and chat.usage.completion_tokens == 3 * 12
    assert len({c.message.content for c in chat.choices}) > 1
    # The router's gRPC API applies the same defaults to a direct caller.
    request = router_pb2.GenerateRequest(
        model=mesh.model, text=PROMPT, sampling=common_pb2.SamplingParams(n=2))
    with grpc.insecure_channel(mesh.router) as channel:
        responses = list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120))
    usage = responses[-1].result.usage
    assert usage.completion_tokens == 2 * DEFAULT_NEW_TOKENS
    texts: dict[int, str] = {}
    for r in responses[:-1]:
        texts[r.delta.index] = texts.get(r.delta.index, "") + r.delta.text
    assert len(set(texts.values())) == 1


def test_a_thinking_request_is_answered_as_reasoning(mesh: Mesh,
                                                     client: openai.OpenAI) -> None:
    """`--reasoning-parser qwen3` under `--default-chat-template-kwargs {enable_thinking:
    false}`: a request is plain content unless it turns thinking on. SmolLM2 never closes a
    thinking block, so a thinking request's output is all reasoning, the same greedy tokens;
    with a JSON schema too, since its grammar waits for `</think>` in both engines (the
    prefill samples the first token, the decode the rest)."""
    if mesh.kind != "1p1d":
        pytest.skip("the 1P+1D mesh runs --reasoning-parser")
    messages: list[Any] = [{"role": "user", "content": PROMPT}]
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    plain = client.chat.completions.create(model=mesh.model, messages=messages, max_tokens=8)
    thought = client.chat.completions.create(model=mesh.model, messages=messages, max_tokens=8,
                                             extra_body=thinking)
    gated = client.chat.completions.create(model=mesh.model, messages=messages, max_tokens=8,
                                           response_format=schema,  # type: ignore[arg-type]
                                           extra_body=thinking)
    text = plain.choices[0].message.content
    assert text and plain.choices[0].message.model_dump().get("reasoning") is None
    for answer in (thought, gated):
        message = answer.choices[0].message.model_dump()
        assert (message["reasoning"], message["content"]) == (text, None)
        assert answer.choices[0].finish_reason == plain.choices[0].finish_reason


def test_a_stream_with_keep_alives_reads_as_the_whole_answer(mesh: Mesh,
                                                             client: openai.OpenAI) -> None:
    """Every line of a raw stream is a `data:` event or a keep-alive comment, and its text is
    the unstreamed answer's."""
    body = {"model": mesh.model, "max_tokens": 8,
            "messages": [{"role": "user", "content": PROMPT}]}
    whole = httpx.post(f"{mesh.base_url}/v1/chat/completions", json=body, timeout=60).json()
    text, lines = "", []
    with httpx.stream("POST", f"{mesh.base_url}/v1/chat/completions",
                      json={**body, "stream": True}, timeout=60) as stream:
        lines = [line for line in stream.iter_lines() if line]
    for line in lines:
        assert line.startswith("data: ") or line == ": keep-alive", line
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    assert lines[-1] == "data: [DONE]"
    assert text == whole["choices"][0]["message"]["content"]


def test_tokenize_detokenize_round_trip(mesh: Mesh, hf_tokenizer: object) -> None:
    text = "Hello, world! Tokenize me."
    resp = httpx.post(f"{mesh.base_url}/tokenize",
                      json={"model": mesh.model, "prompt": text, "return_token_strs": True},
                      timeout=30)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == hf_tokenizer(text)["input_ids"]  # type: ignore[operator]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(body["tokens"])  # type: ignore[attr-defined]
    back = httpx.post(f"{mesh.base_url}/detokenize",
                      json={"model": mesh.model, "tokens": body["tokens"]}, timeout=30)
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": text}
    chat = httpx.post(f"{mesh.base_url}/tokenize", timeout=30, json={
        "model": mesh.model, "messages": [{"role": "user", "content": text}]})
    assert chat.status_code == 200, chat.text
    assert chat.json()["count"] > body["count"]  # the template's markers
    bad = httpx.post(f"{mesh.base_url}/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400, bad.text


def test_completions_echo(mesh: Mesh, client: openai.OpenAI, hf_tokenizer: object) -> None:
    out = client.completions.create(model=mesh.model, prompt=PROMPT, max_tokens=4, echo=True)
    assert out.choices[0].text.startswith(PROMPT)
    assert len(out.choices[0].text) > len(PROMPT)
    stream = client.completions.create(model=mesh.model, prompt=PROMPT, max_tokens=4,
                                       echo=True, stream=True)
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    assert streamed == out.choices[0].text  # greedy by the server default
    ids = hf_tokenizer("The sky is")["input_ids"]  # type: ignore[operator]
    echoed = client.completions.create(model=mesh.model, prompt=ids, max_tokens=2, echo=True)
    assert echoed.choices[0].text.startswith("The sky is")


def test_completions_echo_with_logprobs(mesh: Mesh, client: openai.OpenAI,
                                        hf_tokenizer: object) -> None:
    """vLLM's answer: the prompt's tokens first, the first one's logprob null (no context),
    then the output's; the offsets index the echoed text."""
    prompt_ids = hf_tokenizer(PROMPT)["input_ids"]  # type: ignore[operator]
    out = client.completions.create(model=mesh.model, prompt=PROMPT, max_tokens=2, echo=True,
                                    logprobs=1)
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    n = len(prompt_ids) + 2
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:len(prompt_ids)]) == PROMPT
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset[len(prompt_ids)] == len(PROMPT)
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:] if top is not None)


def test_completions_echo_with_logprobs_streamed(mesh: Mesh, client: openai.OpenAI) -> None:
    """Streamed, each choice opens with its prompt's text and the prompt tokens' logprobs
    (they reach the gateway before the first token); all chunks of a choice together equal
    the unstreamed answer, offsets included. Two prompts, two choices each."""
    prompts = [PROMPT, "The sky is"]
    kwargs = dict(model=mesh.model, prompt=prompts, max_tokens=3, echo=True, logprobs=2, n=2,
                  temperature=0.0)
    whole = client.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks: dict[int, list] = {}
    for chunk in client.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        for c in chunk.choices:
            chunks.setdefault(c.index, []).append(c)
    assert sorted(chunks) == [0, 1, 2, 3]
    for choice in whole.choices:
        parts = chunks[choice.index]
        assert parts[0].text == prompts[choice.index // 2]  # the echo comes first, alone
        assert parts[0].logprobs is not None and parts[0].logprobs.token_logprobs[0] is None
        assert "".join(c.text for c in parts) == choice.text
        streamed = [c.logprobs for c in parts if c.logprobs is not None]
        want = choice.logprobs
        assert want is not None
        assert [t for lp in streamed for t in lp.tokens] == want.tokens
        assert [o for lp in streamed for o in lp.text_offset] == want.text_offset
        got = [x for lp in streamed for x in lp.token_logprobs]
        assert got[0] is None and want.token_logprobs[0] is None
        assert got[1:] == pytest.approx(want.token_logprobs[1:], abs=1e-3)
        assert [sorted(t) if t else t for lp in streamed for t in lp.top_logprobs] == \
            [sorted(t) if t else t for t in want.top_logprobs]


def test_x_request_id_in_and_out(mesh: Mesh) -> None:
    body = {"model": mesh.model, "prompt": PROMPT, "max_tokens": 2}
    resp = httpx.post(f"{mesh.base_url}/v1/completions", json=body, timeout=60,
                      headers={"X-Request-Id": "trace-me-42"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"] == "trace-me-42"
    assert "trace-me-42" in resp.json()["id"]
    resp = httpx.post(f"{mesh.base_url}/v1/completions", json=body, timeout=60)
    assert resp.headers.get("x-request-id")  # one is made up when the client sends none
    # vLLM's body field names it when no header does; the header wins over it.
    resp = httpx.post(f"{mesh.base_url}/v1/completions", timeout=60,
                      json={**body, "request_id": "from-the-body-7"})
    assert resp.status_code == 200, resp.text
    assert "from-the-body-7" in resp.json()["id"]
    assert "x-ignored-fields" not in resp.headers
    resp = httpx.post(f"{mesh.base_url}/v1/completions", timeout=60,
                      json={**body, "request_id": "from-the-body-8"},
                      headers={"X-Request-Id": "from-the-header"})
    assert "from-the-header" in resp.json()["id"]
    bad = httpx.post(f"{mesh.base_url}/v1/completions", timeout=60,
                     json={**body, "request_id": "x" * 200})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"


def test_cors_preflight(mesh: Mesh) -> None:
    preflight = httpx.options(f"{mesh.base_url}/v1/chat/completions", timeout=10, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{mesh.base_url}/v1/chat/completions", timeout=10, headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers


def test_continuous_usage_stats(mesh: Mesh, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=mesh.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=6,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    assert chunks and all(c.usage is not None for c in chunks)
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert content
    counts = [c.usage.completion_tokens for c in content]  # type: ignore[union-attr]
    assert counts == sorted(counts) and counts[-1] <= 6
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens  # type: ignore[union-attr]
               for c in chunks)
    assert chunks[-1].usage.completion_tokens == 6  # type: ignore[union-attr]


def test_stream_interval_sends_several_tokens_per_chunk(mesh: Mesh,
                                                        client: openai.OpenAI) -> None:
    """A request's `stream_interval` (vLLM's extension): after the first token(s) each chunk
    carries that many tokens (or a multiple, when a hop fell behind), the last what is left;
    together they are the unstreamed answer. (1p1d: the prefill instance's token and the
    decode instance's first output each go out at once.)"""
    interval, max_tokens = 4, 18
    kwargs = dict(model=mesh.model, messages=[{"role": "user", "content": PROMPT}],
                  max_tokens=max_tokens, temperature=0.0, logprobs=True,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    stream = client.chat.completions.create(  # type: ignore[call-overload]
        stream=True, **{**kwargs, "extra_body": {"ignore_eos": True,
                                                 "stream_interval": interval}})
    sizes, text = [], ""
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                sizes.append(len(choice.logprobs.content))
            text += choice.delta.content or ""
    assert sum(sizes) == max_tokens
    assert text == whole.choices[0].message.content
    middle = sizes[2:-1]
    assert middle and all(n % interval == 0 for n in middle), sizes
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(stream=True, **{**kwargs, "extra_body": {
            "stream_interval": 0}})
    assert refused.value.param == "stream_interval"


def test_vllm_request_fields_act(mesh: Mesh) -> None:
    """vLLM's fields pdmesh once ignored are taken (X-Ignored-Fields names none of them) and
    act: bad_words keeps a word out of a greedy answer, truncate_prompt_tokens shows in usage,
    return_tokens_as_token_ids names logprob tokens by id, chat_template_kwargs reach the
    template (keys the render sets are a 400 naming the field), prompt_cache_key routes."""
    url = f"{mesh.base_url}/v1/completions"
    body = {"model": mesh.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    plain = httpx.post(url, json=body, timeout=60)
    assert plain.status_code == 200, plain.text
    assert "four" in plain.json()["choices"][0]["text"]
    fields = {"bad_words": ["four"], "truncate_prompt_tokens": 6, "logprobs": 1,
              "return_tokens_as_token_ids": True, "prompt_cache_key": "tenant-1"}
    acted = httpx.post(url, json={**body, **fields}, timeout=60)
    assert acted.status_code == 200, acted.text
    assert "x-ignored-fields" not in acted.headers
    answer = acted.json()
    assert "four" not in answer["choices"][0]["text"]
    assert answer["usage"]["prompt_tokens"] == 6
    tokens = answer["choices"][0]["logprobs"]["tokens"]
    assert tokens and all(t.startswith("token_id:") for t in tokens)

    chat_url = f"{mesh.base_url}/v1/chat/completions"
    messages = [{"role": "user", "content": PROMPT}]
    chat = httpx.post(chat_url, timeout=60, json={
        "model": mesh.model, "messages": messages, "max_tokens": 4,
        "chat_template_kwargs": {"enable_thinking": False}, "prompt_cache_key": "tenant-1",
        "truncate_prompt_tokens": -1, "bad_words": ["four"]})
    assert chat.status_code == 200, chat.text
    assert "x-ignored-fields" not in chat.headers
    refused = httpx.post(chat_url, timeout=60, json={
        "model": mesh.model, "messages": messages,
        "chat_template_kwargs": {"add_generation_prompt": False}})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "chat_template_kwargs"
