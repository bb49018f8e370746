"""A failed KV pull and a dead prefill instance no longer fail requests (issue 10, fault test 2).

Small meshes (redis-server, 1 prefill, 1 decode, router, gateway) as real processes with real
weights; local prefill is off (threshold 0), so every prompt's KV moves from prefill to decode.

The pull is made to fail deterministically, without test hooks in the services: the decode
process is suspended (SIGSTOP) before the requests are sent, so the router's Decode calls wait
in its socket; once every request's Prefill has answered (its first token reached the client,
or the prefill's `exported` count rose), the prefill process is suspended (its KV control
channel no longer answers: the pull times out) or killed (the pull is refused), and only then
is the decode process resumed.

1. recompute (default policy), prefill suspended: every request completes with the tokens of
   an undisturbed run (greedy, seeded, seeded n=2), the decode counts the fallbacks and stays
   routable, the prefill is charged.
2. recompute, prefill killed during the pull: those requests complete the same way; later
   requests are prefilled on the decode instance, and the gateway's /health stays 200.
3. `--kv-load-failure-policy fail`: a clean 503 (UNAVAILABLE) and the decode stays routable.
After each: every surviving engine's free KV blocks return to the total.
"""

from __future__ import annotations

import os
import threading
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.serve import Child, LocalMesh, MeshConfig
from pdmesh.v1 import common_pb2, engine_pb2, router_pb2, router_pb2_grpc
from tests.near_tie import assert_same_or_near_tie, model_vocab_size
from tests.polling import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

KV_MEMORY = "64MiB"
KV_FETCH_TIMEOUT_S = 1.5  # a suspended prefill makes the pull time out after this
LEASE_S = 6.0  # an unpulled KV's blocks come back on the prefill after this
MAX_TOKENS = 10
PROMPT = "Once upon a time, in a quiet village by the sea, there lived an old fisherman who"


def sampling(kind: str) -> common_pb2.SamplingParams:
    """Each kind returns its sampled tokens' logprobs: comparing runs that batch differently
    reads them (tests/near_tie.py)."""
    if kind == "greedy":
        return common_pb2.SamplingParams(temperature=0.0, logprobs=0, max_tokens=MAX_TOKENS,
                                         ignore_eos=True)
    if kind == "seeded":
        return common_pb2.SamplingParams(temperature=0.9, seed=1234, frequency_penalty=0.2,
                                         logprobs=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert kind == "seeded-n2"
    return common_pb2.SamplingParams(n=2, temperature=1.0, seed=77, logprobs=0,
                                     max_tokens=MAX_TOKENS, ignore_eos=True)


KINDS = ("greedy", "seeded", "seeded-n2")
MODEL = "smollm2"




def metric_value(url: str, name: str, **labels: str) -> float | None:
    """The sample `name` (with at least `labels`) served at `url`; None when absent."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return None


@dataclass
class Outcome:
    """One streamed Generate call as the client saw it."""

    first_token: threading.Event = field(default_factory=threading.Event)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    finishes: dict[int, int] = field(default_factory=dict)
    result: router_pb2.GenerateResult | None = None


class Mesh:
    def __init__(self, local: LocalMesh) -> None:
        self.local = local
        self.channel = grpc.insecure_channel(local.router_address)
        self.router = router_pb2_grpc.RouterStub(self.channel)
        self.pool = ThreadPoolExecutor(max_workers=4)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.channel.close()

    @property
    def prefill(self) -> Child:
        return self.local.prefill[0]

    @property
    def decode(self) -> Child:
        return self.local.decode[0]

    @property
    def gateway(self) -> str:
        assert self.local.gateway is not None and self.local.gateway.address
        return f"http://{self.local.gateway.address}"

    def status(self) -> router_pb2.RouterStatus:
        return self.router.GetStatus(router_pb2.GetStatusRequest(), timeout=5)

    def instance(self, role: int) -> router_pb2.InstanceStatus:
        return next(i for i in self.status().instances if i.role == role)

    def generate(self, kind: str, outcome: Outcome | None = None) -> Outcome:
        outcome = outcome or Outcome()
        request = router_pb2.GenerateRequest(text=PROMPT, stream=True, sampling=sampling(kind))
        for resp in self.router.Generate(request, timeout=120):
            if resp.HasField("delta"):
                delta = resp.delta
                outcome.tokens.setdefault(delta.index, []).extend(delta.token_ids)
                outcome.logprobs.setdefault(delta.index, []).extend(
                    lp.logprob for lp in delta.logprobs)
                if delta.HasField("finish"):
                    outcome.finishes[delta.index] = delta.finish.reason
                if delta.token_ids:
                    outcome.first_token.set()
            else:
                outcome.result = resp.result
        return outcome

    def submit(self, kind: str) -> tuple[Outcome, Future[Outcome]]:
        outcome = Outcome()
        return outcome, self.pool.submit(self.generate, kind, outcome)

    def metric(self, child: Child, name: str, **labels: str) -> float | None:
        return metric_value(child.metrics_url, name, **labels)

    def fallbacks(self) -> float:
        """The decode instance's KV-load fallbacks, whatever the reason."""
        with urllib.request.urlopen(self.decode.metrics_url, timeout=10) as resp:
            text = resp.read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples
                   if sample.name == "pdmesh:kv_load_fallbacks_total")

    def wait_blocks_free(self, children: list[Child], timeout_s: float = 60.0) -> None:
        def all_free() -> bool:
            return all(
                self.metric(c, "pdmesh:kv_cache_free_blocks")
                == self.metric(c, "pdmesh:kv_cache_total_blocks") for c in children)

        wait_for(all_free, "every KV block free again", timeout_s=timeout_s)

    def wait_both_healthy(self) -> None:
        wait_for(lambda: len(self.status().instances) == 2
                 and all(i.healthy for i in self.status().instances),
                 "prefill and decode routable", timeout_s=30)


def start_mesh(**env: str) -> Mesh:
    config = MeshConfig(model=MODEL, num_prefill=1, num_decode=1, kv_cache_memory=KV_MEMORY,
                        gateway_port=0, local_prefill_threshold=0)
    child_env = dict(os.environ, PDMESH_KV_FETCH_TIMEOUT_S=str(KV_FETCH_TIMEOUT_S),
                     PDMESH_LEASE_S=str(LEASE_S), **env)
    local = LocalMesh(config, router_args=["--poll-interval-s", "0.2"], env=child_env)
    local.start()
    mesh = Mesh(local)
    try:
        mesh.wait_both_healthy()
    except BaseException:
        mesh.close()
        local.stop()
        raise
    return mesh


@pytest.fixture(name="mesh", scope="class")
def mesh_fixture() -> Iterator[Mesh]:
    mesh = start_mesh()
    try:
        yield mesh
    finally:
        mesh.close()
        mesh.local.stop()


@pytest.fixture(name="expected", scope="class")
def expected_fixture(mesh: Mesh) -> dict[str, Outcome]:
    """Each kind of request on the undisturbed mesh (KV pulled as usual), one at a time."""
    expected = {}
    for kind in KINDS:
        outcome = mesh.generate(kind)
        assert outcome.result is not None
        assert outcome.result.served_by.prefill_instance_id != (
            outcome.result.served_by.decode_instance_id)
        expected[kind] = outcome
    assert mesh.fallbacks() == 0
    return expected


def assert_matches(outcome: Outcome, kind: str, expected: dict[str, Outcome]) -> None:
    """The reference's tokens, or a numerical near-tie away from them: requests batched
    together compute float32 logits a little differently from requests run alone."""
    want = expected[kind]
    assert_same_or_near_tie(sampling(kind), (want.tokens, want.logprobs),
                            (outcome.tokens, outcome.logprobs), model_vocab_size(MODEL), kind)


def pull_fails(mesh: Mesh, kinds: tuple[str, ...], break_prefill: Callable[[], None]
               ) -> list[Outcome]:
    """Send `kinds` with the decode suspended; once every Prefill answered, break the prefill
    (suspend or kill it), then resume the decode: every KV pull fails."""
    decode = psutil.Process(mesh.decode.pid)
    decode.suspend()
    try:
        started = [mesh.submit(kind) for kind in kinds]
        wait_for(lambda: all(o.first_token.is_set() for o, _ in started),
                 "every request's first token (its Prefill answered)", timeout_s=30)
        break_prefill()
    finally:
        decode.resume()
    return [future.result(timeout=60) for _, future in started]


def assert_same_tokens(outcomes: list[Outcome], kinds: tuple[str, ...],
                       expected: dict[str, Outcome]) -> None:
    for outcome, kind in zip(outcomes, kinds, strict=True):
        assert outcome.result is not None, kind
        assert_matches(outcome, kind, expected)
        assert set(outcome.finishes.values()) == {common_pb2.FINISH_REASON_LENGTH}, kind
        n = len(expected[kind].tokens)
        assert outcome.result.usage.completion_tokens == n * MAX_TOKENS
        assert outcome.result.usage.prompt_tokens > 0


class TestRecompute:
    def test_suspended_prefill_pull_times_out_and_decode_recomputes(
        self, mesh: Mesh, expected: dict[str, Outcome]
    ) -> None:
        prefill = psutil.Process(mesh.prefill.pid)
        try:
            outcomes = pull_fails(mesh, KINDS, prefill.suspend)
            assert_same_tokens(outcomes, KINDS, expected)
            assert mesh.metric(mesh.decode, "pdmesh:kv_load_fallbacks_total",
                               reason="timeout") == len(KINDS)
            assert mesh.fallbacks() == len(KINDS)
            # Charged to the prefill instance; the decode instance stays routable.
            decode = mesh.instance(engine_pb2.ROLE_DECODE)
            assert decode.healthy, decode.detail
            charged = mesh.instance(engine_pb2.ROLE_PREFILL)
            assert not charged.healthy
            assert "KV pull" in charged.detail or "polls failing" in charged.detail
        finally:
            prefill.resume()
        mesh.wait_both_healthy()
        mesh.wait_blocks_free([mesh.prefill, mesh.decode], timeout_s=LEASE_S + 60)
        # Served normally again, KV pulled.
        again = mesh.generate("greedy")
        assert_matches(again, "greedy", expected)
        assert again.result is not None
        assert again.result.served_by.prefill_instance_id != (
            again.result.served_by.decode_instance_id)

    def test_killed_prefill_requests_recompute_then_decode_prefills(
        self, mesh: Mesh, expected: dict[str, Outcome]
    ) -> None:
        kinds = ("greedy", "seeded-n2")
        before = mesh.fallbacks()
        outcomes = pull_fails(mesh, kinds, mesh.prefill.kill)
        assert_same_tokens(outcomes, kinds, expected)
        assert mesh.fallbacks() == before + len(kinds)  # refused or reset: no KV came
        assert mesh.instance(engine_pb2.ROLE_DECODE).healthy

        # With no live prefill instance the mesh keeps serving: decode prefills.
        wait_for(lambda: not mesh.instance(engine_pb2.ROLE_PREFILL).healthy,
                 "the dead prefill out of routing")
        health = httpx.get(f"{mesh.gateway}/health", timeout=10)
        assert health.status_code == 200, health.text
        status = mesh.status()
        assert status.serving and "no live prefill instance" in status.serving_detail
        for kind in KINDS:
            outcome = mesh.generate(kind)
            assert_matches(outcome, kind, expected)
            assert outcome.result is not None
            served = outcome.result.served_by
            assert served.prefill_instance_id == served.decode_instance_id
        completion = httpx.post(f"{mesh.gateway}/v1/completions", timeout=60, json={
            "model": "smollm2", "prompt": "Hello", "max_tokens": 2})
        assert completion.status_code == 200, completion.text
        mesh.wait_blocks_free([mesh.decode])


def test_fail_policy_is_a_clean_503_and_charges_the_prefill() -> None:
    mesh = start_mesh(PDMESH_KV_LOAD_FAILURE_POLICY="fail")
    prefill = psutil.Process(mesh.prefill.pid)
    decode = psutil.Process(mesh.decode.pid)
    try:
        exported = mesh.metric(mesh.prefill, "pdmesh:requests_total", outcome="exported") or 0
        decode.suspend()
        try:
            answer = mesh.pool.submit(httpx.post, f"{mesh.gateway}/v1/completions", timeout=60,
                                      json={"model": "smollm2", "prompt": PROMPT,
                                            "max_tokens": 4, "temperature": 0})
            wait_for(lambda: (mesh.metric(mesh.prefill, "pdmesh:requests_total",
                                          outcome="exported") or 0) > exported,
                     "the Prefill answered", timeout_s=30)
            prefill.suspend()
        finally:
            decode.resume()
        resp = answer.result(timeout=60)
        assert resp.status_code == 503, resp.text
        assert "KV" in resp.text
        # Charged to the prefill instance (well before two failed polls would have said so).
        charged = mesh.instance(engine_pb2.ROLE_PREFILL)
        assert not charged.healthy and "KV pull" in charged.detail, charged.detail
        assert mesh.instance(engine_pb2.ROLE_DECODE).healthy
        assert mesh.fallbacks() == 0
        prefill.resume()
        mesh.wait_both_healthy()
        again = httpx.post(f"{mesh.gateway}/v1/completions", timeout=60, json={
            "model": "smollm2", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert again.status_code == 200, again.text
        mesh.wait_blocks_free([mesh.prefill, mesh.decode], timeout_s=LEASE_S + 60)
    finally:
        for process in (prefill, decode):
            if process.is_running() and process.status() == psutil.STATUS_STOPPED:
                process.resume()
        mesh.close()
        mesh.local.stop()
