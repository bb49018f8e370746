"""The OpenAI REST gateway in front of a real mesh, driven by the official `openai` client.

One mesh per module (`pdmesh serve`: redis-server, 1 prefill, 1 decode, router, with local
prefill disabled so KV really moves prefill → decode) and one gateway process with an API key.
Answers are checked against `pdmesh.LLM` greedy output on the same weights.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from pdmesh.auth import METADATA_KEY, TOKEN_ENV
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.gateway.app import create_app
from pdmesh.gateway.config import GatewayConfig
from pdmesh.serve import Child, pdmesh_command
from pdmesh.v1 import engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from tests.metrics_text import counter
from tests.polling import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

API_KEY = "test-key-123"
MAX_TOKENS = 12
PROMPTS = ["The three primary colors are", "Paris is the capital of"]
CHAT = [{"role": "user", "content": "Name a fruit."}]
KV_MEMORY = "96MiB"
CLUSTER_TOKEN = "gateway-test-cluster-token"
"""Given to `pdmesh serve` (which otherwise makes one per run) so this module's own router and
direct engine calls can authenticate to its engines."""
ENV = {**os.environ, TOKEN_ENV: CLUSTER_TOKEN}




class Mesh:
    def __init__(self, router: str, gateway: str) -> None:
        self.router = router
        self.base_url = f"http://{gateway}"

    def instances(self) -> list[router_pb2.InstanceStatus]:
        with grpc.insecure_channel(self.router) as channel:
            status = router_pb2_grpc.RouterStub(channel).GetStatus(
                router_pb2.GetStatusRequest(), timeout=5)
        return list(status.instances)

    def loads(self) -> list[engine_pb2.EngineLoad]:
        out = []
        for inst in self.instances():
            stub_cls = (engine_pb2_grpc.PrefillStub if inst.role == engine_pb2.ROLE_PREFILL
                        else engine_pb2_grpc.DecodeStub)
            with grpc.insecure_channel(inst.address) as channel:
                out.append(stub_cls(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=5,
                                                     metadata=((METADATA_KEY, CLUSTER_TOKEN),)))
        return out


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    """`pdmesh serve` with its gateway, as a user starts it (free ports, an API key)."""
    serve = Child("serve", pdmesh_command(
        "serve", "--num-prefill", "1", "--num-decode", "1", "--kv-cache-memory", KV_MEMORY,
        "--local-prefill-threshold", "0", "--gateway-port", "0", "--api-key", API_KEY), env=ENV)
    try:
        router = serve.wait_ready(timeout_s=240)
        url = next(p for p in serve.ready_line.split() if p.startswith("gateway="))
        gateway = url.removeprefix("gateway=http://").removesuffix("/v1")
        yield Mesh(router, gateway)
    finally:
        serve.terminate(grace_s=30)


@pytest.fixture(scope="module")
def llm() -> Any:
    from pdmesh import LLM

    return LLM("smollm2", kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def reference(llm: Any) -> dict[str, Any]:
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return {
        "completions": llm.generate(PROMPTS, greedy),
        "chat": llm.chat(CHAT, greedy)[0],
    }


@pytest.fixture()
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


@pytest.fixture()
def aclient(mesh: Mesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh.base_url}/v1", api_key=API_KEY, max_retries=0,
                              timeout=120)


# -- answers -------------------------------------------------------------------------------
def test_models_health_and_metrics(mesh: Mesh, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2"]
    health = httpx.get(f"{mesh.base_url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    metrics = httpx.get(f"{mesh.base_url}/metrics", timeout=10)
    assert metrics.status_code == 200
    assert counter(metrics.text, "pdmesh:gateway_requests_total", endpoint="/v1/models",
                   status="200") >= 1


def test_completions_match_llm_greedy(client: openai.OpenAI, reference: dict) -> None:
    resp = client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                     temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    for choice, ref in zip(resp.choices, reference["completions"], strict=True):
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in
                                           reference["completions"])
    assert resp.usage.completion_tokens == 2 * MAX_TOKENS
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_token_id_prompt_streams_the_same_text(client: openai.OpenAI, reference: dict) -> None:
    ref = reference["completions"][1]
    stream = client.completions.create(
        model="smollm2", prompt=list(ref.prompt_token_ids), max_tokens=MAX_TOKENS,
        temperature=0, stream=True, stream_options={"include_usage": True})
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    assert text == ref.outputs[0].text and finish == "length"
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    assert usage.prompt_tokens == len(ref.prompt_token_ids)
    # The same prompt again: its full blocks are served from the prefill's prefix cache.
    again = client.completions.create(model="smollm2", prompt=list(ref.prompt_token_ids),
                                      max_tokens=2, temperature=0)
    details = again.usage.prompt_tokens_details if again.usage else None
    assert details is not None and details.cached_tokens is not None


def test_chat_matches_llm_chat(client: openai.OpenAI, reference: dict) -> None:
    resp = client.chat.completions.create(model="smollm2", messages=CHAT,
                                          max_completion_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == reference["chat"].outputs[0].text
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(reference["chat"].prompt_token_ids)


def test_async_streaming_chat(aclient: openai.AsyncOpenAI, reference: dict) -> None:
    async def run() -> tuple[list[Any], str]:
        stream = await aclient.chat.completions.create(
            model="smollm2", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return chunks, text

    chunks, text = asyncio.run(run())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == reference["chat"].outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    ref = reference["chat"].outputs[0]
    assert finishes[-1] == ref.finish_reason and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_async_completions_non_streaming(aclient: openai.AsyncOpenAI, reference: dict) -> None:
    async def run() -> list[Any]:
        return await asyncio.gather(*(
            aclient.completions.create(model="smollm2", prompt=p, max_tokens=MAX_TOKENS,
                                       temperature=0) for p in PROMPTS))

    for resp, ref in zip(asyncio.run(run()), reference["completions"], strict=True):
        assert resp.choices[0].text == ref.outputs[0].text


def test_n_and_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        resp = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=8,
                                         temperature=1.0, n=3, seed=seed)
        assert sorted(c.index for c in resp.choices) == [0, 1, 2]
        assert resp.usage is not None and resp.usage.completion_tokens == sum(
            len(c.logprobs.tokens) if c.logprobs else 8 for c in resp.choices)
        return [c.text for c in sorted(resp.choices, key=lambda c: c.index)]

    first = sample(1234)
    assert sample(1234) == first
    assert all(first)


def test_stop_string(client: openai.OpenAI, reference: dict) -> None:
    ref_text = reference["completions"][0].outputs[0].text
    stop = ref_text.split()[2]  # a word in the middle of the greedy answer
    expected = ref_text[: ref_text.index(stop)]
    resp = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                     temperature=0, stop=[stop])
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"


def test_logprobs(client: openai.OpenAI, reference: dict) -> None:
    resp = client.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=6,
                                     temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert len(lp.tokens) == 6 and "".join(lp.tokens) == resp.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) >= 3 and logprob <= 0
        # greedy: the sampled token is the most likely one
        assert logprob == pytest.approx(max(top.values()), abs=1e-5) and token in top

    chat = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and len(content) == 5
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)


# -- errors ----------------------------------------------------------------------------------
def _error_body(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert list(body["error"]) == ["message", "type", "param", "code"]  # vLLM's ErrorInfo
    return body["error"]


def test_validation_errors_are_400_naming_the_param(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt="x", temperature=-1)
    assert _error_body(info.value)["param"] == "temperature"
    # Unknown fields are ignored, as vLLM does, and named in a header.
    raw = client.completions.with_raw_response.create(model="smollm2", prompt="x", max_tokens=1,
                                                      extra_body={"bogus": 1})
    assert raw.headers["x-ignored-fields"] == "bogus"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt="x", max_tokens=10**6)
    assert _error_body(info.value)["param"] == "max_tokens"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-none", messages=CHAT, max_tokens=2)
    assert _error_body(info.value)["type"] == "NotFoundError"
    assert _error_body(info.value)["code"] == 404


def test_bad_api_key_is_401(mesh: Mesh) -> None:
    bad = openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.response.json() == {"error": "Unauthorized"}  # vLLM's 401 body
    # /health stays open for load balancers.
    assert httpx.get(f"{mesh.base_url}/health", timeout=10).status_code == 200


def test_no_router_is_503() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(GatewayConfig(router_address=f"127.0.0.1:{port}", control_timeout_s=2))
    with TestClient(app) as http:
        resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["type"] == "Service Unavailable"
        assert http.get("/health").status_code == 503


def _stream_lines(http: httpx.Client, url: str, body: dict) -> Any:
    return http.stream("POST", url, json=body, headers={"Authorization": f"Bearer {API_KEY}"})


def test_disconnect_mid_stream_frees_kv_blocks(mesh: Mesh) -> None:
    wait_for(lambda: all(ld.num_running == 0 for ld in mesh.loads()), "an idle mesh")
    body = {"prompt": PROMPTS[0], "max_tokens": 1500, "ignore_eos": True, "temperature": 0,
            "stream": True}
    url = f"{mesh.base_url}/v1/completions"
    with httpx.Client(timeout=60) as http, _stream_lines(http, url, body) as resp:
        assert resp.status_code == 200
        got = 0
        for line in resp.iter_lines():
            got += line.startswith("data:")
            if got >= 3:
                break
        busy = [ld for ld in mesh.loads() if ld.role == engine_pb2.ROLE_DECODE]
        assert busy[0].num_running == 1
        assert busy[0].num_free_blocks < busy[0].num_total_blocks
    # leaving the block closed the connection mid-stream

    def all_free() -> list[engine_pb2.EngineLoad] | None:
        loads = mesh.loads()
        ok = all(ld.num_running == 0 and ld.num_waiting == 0 and ld.num_pinned_blocks == 0
                 and ld.num_free_blocks == ld.num_total_blocks for ld in loads)
        return loads if ok else None

    wait_for(all_free, "every KV block freed after the disconnect", timeout_s=30)
    text = httpx.get(f"{mesh.base_url}/metrics", timeout=10).text
    assert counter(text, "pdmesh:gateway_client_disconnects_total",
                   endpoint="/v1/completions") == 1


def _router_running(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        status = router_pb2_grpc.RouterStub(channel).GetStatus(router_pb2.GetStatusRequest(),
                                                               timeout=5)
    return status.num_running


def test_overload_is_429_with_retry_after(mesh: Mesh) -> None:
    """A second router over the same engines, admitting one request and queueing none."""
    roles = {engine_pb2.ROLE_PREFILL: "--prefill", engine_pb2.ROLE_DECODE: "--decode"}
    addresses = [a for inst in mesh.instances() for a in (roles[inst.role], inst.address)]
    router = Child("router-limited", pdmesh_command(
        "router", "--port", "0", "--max-concurrent-requests", "1", "--max-queued-requests", "0",
        "--local-prefill-threshold", "0", *addresses), env=ENV)
    gateway: Child | None = None
    try:
        address = router.wait_ready(timeout_s=60)
        gateway = Child("gateway-limited", pdmesh_command(
            "gateway", "--router-address", address, "--port", "0", "--api-key", API_KEY),
            env=ENV)
        base = f"http://{gateway.wait_ready(timeout_s=60)}"
        body = {"prompt": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, _stream_lines(
            http, f"{base}/v1/completions", body
        ) as first:
            assert first.status_code == 200
            # Keep the line iterator referenced: a discarded httpx iterator closes the
            # connection, which the gateway rightly treats as a client disconnect.
            lines = first.iter_lines()
            line = next(lines)  # admitted and producing
            assert line.startswith("data:") and '"error"' not in line, line
            wait_for(lambda: _router_running(address) == 1, "the limited router's one slot taken")
            limited = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
            with pytest.raises(openai.RateLimitError) as info:
                limited.completions.create(model="smollm2", prompt="x", max_tokens=2)
            assert int(info.value.response.headers["retry-after"]) >= 1
            assert _error_body(info.value)["code"] == 429
            assert _router_running(address) == 1  # the first stream is still being served
            del lines
    finally:
        if gateway is not None:
            gateway.terminate()
        router.terminate()
