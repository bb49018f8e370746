"""Graceful drain (issue 10, fault test 3): SIGTERM stops a process without cutting its streams.

Decode: one mesh (1 prefill + 2 decode, real processes, Redis and weights; local prefill off so
KV really moves; round-robin routing so both decodes serve streams). The same requests (greedy
and seeded mixed, long enough to last seconds) run once undisturbed — the reference — and once
more with one decode instance sent SIGTERM while every stream is running. The victim's streams
must finish *on the victim* (not cut, not migrated) with the reference's tokens; requests sent
during its drain go to the other decode; it exits 0 well within `--drain-timeout-s`; the
survivors hold no block afterwards.

Router: SIGTERM the router while streams run; they finish complete, a new call is refused with
UNAVAILABLE and a retry hint, and the router exits 0.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.serve import LocalMesh, MeshConfig
from pdmesh.v1 import common_pb2, engine_pb2, router_pb2, router_pb2_grpc
from tests.polling import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

DRAIN_TIMEOUT_S = 60.0
MAX_TOKENS = 128
STARTED_AFTER_TOKENS = 3  # every stream has at least this many tokens at the SIGTERM
PROMPTS = [
    "The three primary colors are red, yellow and blue. Mixing two of them gives",
    "Paris is the capital of France, and its most famous monument is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


def sampling(i: int) -> common_pb2.SamplingParams:
    """Request i: greedy (even) or seeded (odd), never stopping before MAX_TOKENS."""
    if i % 2:
        return common_pb2.SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i,
                                         max_tokens=MAX_TOKENS, ignore_eos=True)
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


REQUESTS = [(PROMPTS[i % len(PROMPTS)], sampling(i)) for i in range(6)]




@dataclass
class Stream:
    """What one client saw of one streamed request."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: common_pb2.Finish | None = None
    result: router_pb2.GenerateResult | None = None
    errors: list[str] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)


def run_stream(address: str, prompt: list[int], params: common_pb2.SamplingParams,
               stream: Stream) -> Stream:
    try:
        with grpc.insecure_channel(address) as channel:
            call = router_pb2_grpc.RouterStub(channel).Generate(
                router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt),
                                           stream=True, sampling=params), timeout=180)
            for resp in call:
                if resp.HasField("result"):
                    stream.result = resp.result
                    continue
                if stream.finish is not None:
                    stream.errors.append("delta after the finish")
                stream.tokens.extend(resp.delta.token_ids)
                stream.text += resp.delta.text
                if resp.delta.HasField("finish"):
                    stream.finish = resp.delta.finish
                    if stream.finish.reason == common_pb2.FINISH_REASON_ERROR:
                        stream.errors.append(f"error event: {stream.finish.message}")
                if len(stream.tokens) >= STARTED_AFTER_TOKENS:
                    stream.started.set()
    except grpc.RpcError as exc:
        stream.errors.append(f"{exc.code().name}: {exc.details()}")
    stream.started.set()
    return stream


def run_all(address: str, prompts: dict[str, list[int]],
            on_started: Callable[[list[Stream]], None] | None = None) -> list[Stream]:
    streams = [Stream() for _ in REQUESTS]
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        futures = [pool.submit(run_stream, address, prompts[prompt], params, stream)
                   for (prompt, params), stream in zip(REQUESTS, streams, strict=True)]
        if on_started is not None:
            for stream in streams:
                assert stream.started.wait(timeout=180), "a stream never started"
            on_started(streams)
        return [f.result(timeout=300) for f in futures]


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def healthy_decodes(router: router_pb2_grpc.RouterStub) -> list[router_pb2.InstanceStatus]:
    status = router.GetStatus(router_pb2.GetStatusRequest(), timeout=5)
    return [i for i in status.instances if i.role == engine_pb2.ROLE_DECODE and i.healthy]


def start_mesh(num_decode: int, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> LocalMesh:
    config = MeshConfig(num_prefill=1, num_decode=num_decode, kv_cache_memory="96MiB",
                        local_prefill_threshold=0, routing_policy="round_robin",
                        gateway_port=-1)
    env = dict(os.environ, PDMESH_DRAIN_TIMEOUT_S=str(drain_timeout_s))
    local = LocalMesh(config, env=env)
    local.start()
    return local


@pytest.fixture()
def mesh() -> Iterator[LocalMesh]:
    local = start_mesh(num_decode=2)
    try:
        yield local
    finally:
        local.stop()


def tokenize_and_warm(router: router_pb2_grpc.RouterStub) -> dict[str, list[int]]:
    """Token ids of PROMPTS; one short request each warms the prefill's prefix cache, so the
    reference and the disturbed run see the same hits."""
    prompts = {p: list(router.Tokenize(router_pb2.TokenizeRequest(text=p),
                                       timeout=30).token_ids) for p in PROMPTS}
    for ids in prompts.values():
        list(router.Generate(router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=ids),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=1)), timeout=60))
    return prompts


def short_request(router: router_pb2_grpc.RouterStub, ids: list[int]) -> router_pb2.GenerateResult:
    responses = list(router.Generate(router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=4)), timeout=60))
    return responses[-1].result


def test_sigterm_decode_finishes_its_streams_and_exits_0(mesh: LocalMesh) -> None:
    with grpc.insecure_channel(mesh.router_address) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        wait_for(lambda: len(healthy_decodes(router)) == 2, "2 healthy decodes")
        prompts = tokenize_and_warm(router)
        reference = run_all(mesh.router_address, prompts)
        for ref in reference:
            assert not ref.errors and ref.result is not None, ref.errors

        victim, survivor = mesh.decode[0], mesh.decode[1]
        ids = {i.address: i.instance_id for i in healthy_decodes(router)}
        victim_id, survivor_id = ids[victim.address], ids[survivor.address]
        terminated: list[float] = []
        during_drain: list[tuple[router_pb2.GenerateResult, bool]] = []

        def sigterm(streams: list[Stream]) -> None:
            terminated.append(time.monotonic())
            victim.proc.terminate()
            # New requests while the victim drains: served by the other decode.
            for prompt_ids in prompts.values():
                result = short_request(router, prompt_ids)
                during_drain.append((result, victim.running()))

        disturbed = run_all(mesh.router_address, prompts, on_started=sigterm)
        code = victim.proc.wait(timeout=DRAIN_TIMEOUT_S + 30)
        exited_after_s = time.monotonic() - terminated[0]

        for i, (ref, got) in enumerate(zip(reference, disturbed, strict=True)):
            assert not got.errors, f"request {i}: {got.errors}"
            assert got.result is not None, f"request {i}: no result"
            assert got.tokens == ref.tokens, f"request {i}: tokens differ"
            assert got.text == ref.text, f"request {i}: text differs"
            assert got.result.usage.completion_tokens == MAX_TOKENS
        finished_on_victim = [i for i, s in enumerate(disturbed)
                              if s.result and s.result.served_by.decode_instance_id == victim_id]
        assert len(finished_on_victim) >= 2, (
            f"the victim's in-flight streams were cut instead of drained: served by "
            f"{[s.result.served_by.decode_instance_id if s.result else None for s in disturbed]}"
            f", victim {victim_id}")
        assert code == 0, f"the drained decode exited with {code}"
        assert exited_after_s < DRAIN_TIMEOUT_S, f"drain took {exited_after_s:.1f}s"
        assert during_drain and any(running for _, running in during_drain), (
            "the victim had exited before any new request was sent")
        for result, _ in during_drain:
            assert result.served_by.decode_instance_id == survivor_id
        # After the drain the mesh serves on, and the survivors hold nothing.
        wait_for(lambda: len(healthy_decodes(router)) == 1, "the victim leaves the router")
        assert short_request(router, prompts[PROMPTS[0]]).usage.completion_tokens == 4

    urls = mesh.metrics_urls()

    def nothing_held() -> bool:
        for name in (survivor.name, mesh.prefill[0].name):
            samples = scrape(urls[name])
            if samples["pdmesh:kv_cache_free_blocks"] != samples["pdmesh:kv_cache_total_blocks"]:
                return False
        return True

    wait_for(nothing_held, "every surviving engine's blocks free", timeout_s=30)


def test_drain_timeout_cuts_what_is_left_and_the_router_migrates_it() -> None:
    """A drain that cannot finish in time: after `--drain-timeout-s` the victim cuts its
    streams (they continue on the other decode, token-exact) and still exits 0 promptly."""
    timeout_s = 1.0
    mesh = start_mesh(num_decode=2, drain_timeout_s=timeout_s)
    try:
        with grpc.insecure_channel(mesh.router_address) as channel:
            router = router_pb2_grpc.RouterStub(channel)
            wait_for(lambda: len(healthy_decodes(router)) == 2, "2 healthy decodes")
            prompts = tokenize_and_warm(router)
            reference = run_all(mesh.router_address, prompts)
            victim = mesh.decode[0]
            exits: list[tuple[int, float, int]] = []  # (code, seconds after SIGTERM, running)

            def sigterm(streams: list[Stream]) -> None:
                terminated = time.monotonic()
                victim.proc.terminate()
                code = victim.proc.wait(timeout=60)
                running = sum(1 for s in streams if s.finish is None)
                exits.append((code, time.monotonic() - terminated, running))

            disturbed = run_all(mesh.router_address, prompts, on_started=sigterm)
        for i, (ref, got) in enumerate(zip(reference, disturbed, strict=True)):
            assert not got.errors, f"request {i}: {got.errors}"
            assert got.tokens == ref.tokens, f"request {i}: tokens differ"
        code, exited_after_s, running = exits[0]
        assert code == 0
        assert exited_after_s < timeout_s + 10, f"exited {exited_after_s:.1f}s after SIGTERM"
        assert running, "every stream had ended before the victim exited: nothing was cut"
    finally:
        mesh.stop()


def test_sigterm_router_finishes_its_streams_refuses_new_ones_and_exits_0() -> None:
    mesh = start_mesh(num_decode=1)
    try:
        assert mesh.router is not None
        with grpc.insecure_channel(mesh.router_address) as channel:
            router = router_pb2_grpc.RouterStub(channel)
            wait_for(lambda: len(healthy_decodes(router)) == 1, "a healthy decode")
            prompts = tokenize_and_warm(router)
            refusals: list[grpc.RpcError] = []

            def sigterm(streams: list[Stream]) -> None:
                assert mesh.router is not None
                mesh.router.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and not refusals:
                    try:
                        short_request(router, prompts[PROMPTS[0]])  # before the signal landed
                    except grpc.RpcError as exc:
                        refusals.append(exc)

            streams = run_all(mesh.router_address, prompts, on_started=sigterm)
            code = mesh.router.proc.wait(timeout=DRAIN_TIMEOUT_S + 30)
        for i, got in enumerate(streams):
            assert not got.errors, f"request {i}: {got.errors}"
            assert got.result is not None and got.result.usage.completion_tokens == MAX_TOKENS
        assert refusals, "no new call was refused while the router drained"
        refused = refusals[0]
        assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
        trailing = dict(refused.trailing_metadata() or ())
        assert int(trailing["retry-after-ms"]) > 0
        assert code == 0
    finally:
        mesh.stop()
