"""A decode instance that stops (SIGTERM) or dies (SIGKILL) while the mesh serves: requests
that would have gone to it are re-routed to the other decode, none is answered with 500, and
with no decode left the gateway answers 503 with Retry-After.

Each test starts its own small mesh (1 prefill + 2 decode, gateway on, local prefill off so KV
really moves and the prefill's first token reaches the router before Decode is called). The
deterministic tests use round-robin routers with a 30 s poll interval, so the routers still
believe in a killed decode when the next request arrives: the instance whose id sorts first
gets a fresh round-robin router's first request.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import httpx
import pytest

from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.serve import Child, LocalMesh, MeshConfig, pdmesh_command
from pdmesh.v1 import common_pb2, engine_pb2, router_pb2, router_pb2_grpc
from tests.polling import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

KV_MEMORY = "96MiB"
MAX_TOKENS = 6
PROMPTS = [
    "The three primary colors are",
    "Paris is the capital of",
    "def fibonacci(n):",
    "The quick brown fox",
]
WORKERS = 8
REQUESTS_PER_WORKER = 6
SIGTERM_AFTER = 10  # completed requests before the victim is stopped




@dataclass
class Answer:
    """One HTTP completion as the client saw it."""

    sent_at: float  # monotonic
    status: int
    text: str
    error: str  # "" when the answer is complete and error-free
    headers: dict[str, str]


def complete(http: httpx.Client, prompt: str, *, stream: bool,
             max_tokens: int = MAX_TOKENS) -> Answer:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    sent_at = time.monotonic()
    with http.stream("POST", "/completions", json=body) as resp:
        raw = resp.read().decode()
        headers = dict(resp.headers)
        if resp.status_code != 200:
            return Answer(sent_at, resp.status_code, "", raw, headers)
    if not stream:
        return Answer(sent_at, 200, json.loads(raw)["choices"][0]["text"], "", headers)
    text, error, done = "", "", False
    for line in raw.splitlines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            error = json.dumps(chunk["error"])
            continue
        choice = chunk["choices"][0]
        text += choice["text"]
        if choice.get("finish_reason") == "error":
            error = error or "finish_reason=error"
    if not done:
        error = error or "stream ended without [DONE]"
    return Answer(sent_at, 200, text, error, headers)


def start_mesh(policy: str, router_args: list[str]) -> LocalMesh:
    config = MeshConfig(
        num_prefill=1, num_decode=2, kv_cache_memory=KV_MEMORY, local_prefill_threshold=0,
        routing_policy=policy, gateway_port=0,
    )
    mesh = LocalMesh(config, router_args=router_args)
    mesh.start()
    return mesh


def router_status(address: str) -> router_pb2.RouterStatus:
    with grpc.insecure_channel(address) as channel:
        return router_pb2_grpc.RouterStub(channel).GetStatus(
            router_pb2.GetStatusRequest(), timeout=5)


def healthy_decodes(address: str) -> list[router_pb2.InstanceStatus]:
    return [i for i in router_status(address).instances
            if i.role == engine_pb2.ROLE_DECODE and i.healthy]


def metric_total(url: str, name: str, **labels: str) -> float:
    """The sum of `name`'s series whose labels include `labels`."""
    wanted = {f'{k}="{v}"' for k, v in labels.items()}
    total = 0.0
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(f"{name}{{"):
            series, _, value = line.rpartition(" ")
            if wanted <= set(series[len(name) + 1:-1].split(",")):
                total += float(value)
    return total


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[list[int], str]]:
    """Greedy outputs of the offline engine, the ground truth the mesh must reproduce."""
    from pdmesh import LLM

    llm = LLM("smollm2", kv_cache_memory="64MiB")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return {p: (list(o.outputs[0].token_ids), o.outputs[0].text)
            for p, o in zip(PROMPTS, outs, strict=True)}


# -- SIGTERM under steady load ---------------------------------------------------------------------
def test_sigterm_decode_under_load_every_later_request_succeeds() -> None:
    mesh = start_mesh("prefix_aware", [])
    try:
        assert mesh.gateway_url is not None
        wait_for(lambda: len(healthy_decodes(mesh.router_address)) == 2, "2 healthy decodes")
        victim = mesh.decode[0]
        # The stop is taken under the same lock the workers count completions with, so the
        # requests sent before it are exactly those completed by then plus at most one in flight
        # per worker (a semaphore let more complete between the 10th release and the SIGTERM).
        progress = threading.Condition()
        completed = [0]
        stopped_at: list[float] = []

        def worker(w: int) -> list[Answer]:
            answers = []
            with httpx.Client(base_url=mesh.gateway_url or "", timeout=120) as http:
                for r in range(REQUESTS_PER_WORKER):
                    prompt = PROMPTS[(w + r) % len(PROMPTS)]
                    answers.append(complete(http, prompt, stream=w % 2 == 0))
                    with progress:
                        completed[0] += 1
                        progress.notify_all()
            return answers

        with ThreadPoolExecutor(WORKERS) as pool:
            futures = [pool.submit(worker, w) for w in range(WORKERS)]
            with progress:
                assert progress.wait_for(lambda: completed[0] >= SIGTERM_AFTER, timeout=600), \
                    "the load made no progress"
                completed_at_stop = completed[0]
                stopped_at.append(time.monotonic())
                victim.proc.terminate()
            answers = [a for f in futures for a in f.result(timeout=300)]
        assert victim.proc.wait(timeout=30) == 0
        after = [a for a in answers if a.sent_at > stopped_at[0]]
        total = WORKERS * REQUESTS_PER_WORKER
        assert len(after) >= min(WORKERS, total - completed_at_stop - WORKERS)
        assert len(answers) - len(after) <= completed_at_stop + WORKERS
        failed = [(a.status, a.error[:300]) for a in after if a.status != 200 or a.error]
        assert not failed, f"{len(failed)} of {len(after)} requests after SIGTERM failed: {failed}"
        assert not [a for a in answers if a.status == 500]
        dead = [i for i in router_status(mesh.router_address).instances
                if i.address == victim.address]
        assert dead and not dead[0].healthy
    finally:
        mesh.stop()


# -- SIGKILL before the router notices -------------------------------------------------------------
@dataclass
class KillMesh:
    local: LocalMesh
    rr2: Child  # a second round-robin router over the same instances (gRPC, no gateway)
    http: httpx.Client


@pytest.fixture()
def kill_mesh() -> Iterator[KillMesh]:
    slow_polls = ["--poll-interval-s", "30"]
    local = start_mesh("round_robin", slow_polls)
    rr2: Child | None = None
    try:
        rr2 = Child("rr-router-2", pdmesh_command("router", *local._router_argv()))
        rr2.wait_ready(timeout_s=120)
        for address in (local.router_address, rr2.address or ""):
            wait_for(lambda a=address: len(healthy_decodes(a)) == 2, "2 healthy decodes")
        with httpx.Client(base_url=local.gateway_url or "", timeout=120) as http:
            yield KillMesh(local, rr2, http)
    finally:
        if rr2 is not None:
            rr2.terminate()
        local.stop()


def _first_in_turn(mesh: KillMesh) -> Child:
    """The decode a fresh round-robin router picks first: the lowest instance id."""
    decodes = sorted(healthy_decodes(mesh.local.router_address), key=lambda i: i.instance_id)
    return next(c for c in mesh.local.decode if c.address == decodes[0].address)


def _grpc_stream(address: str, prompt: str) -> tuple[list[int], router_pb2.GenerateResult]:
    tokens: list[int] = []
    result: router_pb2.GenerateResult | None = None
    with grpc.insecure_channel(address) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(
            router_pb2.GenerateRequest(
                text=prompt, stream=True,
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)),
            timeout=120)
        for resp in call:
            if resp.HasField("delta"):
                tokens += resp.delta.token_ids
                assert resp.delta.finish.reason != common_pb2.FINISH_REASON_ERROR, resp.delta
            else:
                result = resp.result
    assert result is not None
    return tokens, result


def test_killed_decode_requests_rerouted_then_503_when_none_left(
    kill_mesh: KillMesh, reference: dict[str, tuple[list[int], str]]
) -> None:
    mesh = kill_mesh
    victim = _first_in_turn(mesh)
    survivor = next(c for c in mesh.local.decode if c is not victim)
    metrics_url = mesh.local.router.metrics_url if mesh.local.router else ""
    before = metric_total(metrics_url, "pdmesh:router_reroutes_total", role="decode")
    victim.kill()

    # The gateway's router still routes to the victim (no poll since): the non-streamed
    # request is re-routed and answered in full.
    answer = complete(mesh.http, PROMPTS[0], stream=False)
    assert (answer.status, answer.error) == (200, ""), answer
    assert answer.text == reference[PROMPTS[0]][1]
    assert metric_total(metrics_url, "pdmesh:router_reroutes_total", role="decode") == before + 1

    # The second router streams: the prefill's first token is already out when Decode fails
    # to connect, and the re-routed Decode continues without repeating it.
    tokens, result = _grpc_stream(mesh.rr2.address or "", PROMPTS[1])
    assert tokens == reference[PROMPTS[1]][0]
    assert result.usage.completion_tokens == len(tokens)
    survivor_id = next(i.instance_id for i in healthy_decodes(mesh.rr2.address or "")
                       if i.address == survivor.address)
    assert result.served_by.decode_instance_id == survivor_id
    assert metric_total(mesh.rr2.metrics_url, "pdmesh:router_reroutes_total", role="decode") == 1

    # Both decodes gone, the router not yet aware of the second: 503 + Retry-After, not 500;
    # after that no decode is routable at all, and a streamed request is refused the same way.
    survivor.kill()
    for stream in (False, True):
        gone = complete(mesh.http, PROMPTS[2], stream=stream)
        assert gone.status == 503, gone
        assert int(gone.headers["retry-after"]) >= 1
        error = json.loads(gone.error)["error"]
        assert error["type"] == "Service Unavailable" and "decode" in error["message"]
