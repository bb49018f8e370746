"""A hung instance (SIGSTOP): its calls move after the stall bound instead of waiting out the
hang, token-exact, and new requests avoid it until it steps again.

One mesh (1 prefill + 2 decode, real processes, Redis and weights, the default knobs; local
prefill off so KV really moves; round-robin routing so both decodes serve streams). The same 8
requests (greedy and seeded mixed, one with n = 2) run once undisturbed — the reference —
and then again while a process is stopped:

* a decode instance's engine core, mid-stream: its service still answers, sees the core owe
  answers and turns NOT_SERVING; the router migrates the streams and routes around it;
* a whole decode instance (service and core), mid-stream: polls and calls go unanswered;
* the prefill instance (service and core), with requests on their way to it: they move to
  local prefill on their decode instance.

Each stream must carry the reference's tokens (or part from it only at a near-tie,
tests/near_tie.py, as in test_faults_migration.py) with no error, and no pause longer than the
stall bound plus the move. Stopped processes are always continued (finally), and each test
ends with every instance routable again and every block free.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.engine.frontend.stall import StallBound
from pdmesh.serve import Child, LocalMesh, MeshConfig
from pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from tests.near_tie import assert_same_or_near_tie, model_vocab_size
from tests.polling import wait_for
from tests.router_streams import PROMPTS, Stream, mixed_requests, run_stream

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

MAX_TOKENS = 48
STOP_AFTER_TOKENS = 3  # every stream has at least this many tokens when the process stops
CONFIRM_S = 2.0  # the router's --rpc-timeout-s: its last GetLoad to a stopped process times out
MOVE_SLACK_S = 10.0  # the move itself: a resume prefill elsewhere, on a busy 2-CPU machine

REQUESTS = mixed_requests(MAX_TOKENS)


def run_all(address: str, prompts: dict[str, list[int]], indices: list[int],
            on_started: Callable[[], None] | None = None) -> dict[int, Stream]:
    """Requests `indices` of REQUESTS at once; `on_started` once each has a few tokens."""
    streams = {i: Stream() for i in indices}
    with ThreadPoolExecutor(len(indices)) as pool:
        futures = {i: pool.submit(run_stream, address, prompts[REQUESTS[i][0]], REQUESTS[i][1],
                                  streams[i], started_after=STOP_AFTER_TOKENS,
                                  timeout_s=240) for i in indices}
        if on_started is not None:
            for stream in streams.values():
                assert stream.started.wait(timeout=180), "a stream never started"
            on_started()
        return {i: f.result(timeout=400) for i, f in futures.items()}


@contextmanager
def stoppable(*pids: int) -> Iterator[Callable[[], float]]:
    """A function that SIGSTOPs `pids` (returning when); whatever happens they are continued."""
    def stop() -> float:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return time.monotonic()

    try:
        yield stop
    finally:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def core_pid(child: Child) -> int:
    return int(child.fields["core_pid"])


def scrape(url: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


@dataclass
class Mesh:
    local: LocalMesh
    router: router_pb2_grpc.RouterStub
    prompts: dict[str, list[int]]
    reference: dict[int, Stream]

    def status(self, child: Child) -> router_pb2.InstanceStatus:
        return next(i for i in self.router.GetStatus(router_pb2.GetStatusRequest(),
                                                     timeout=5).instances
                    if i.address == child.address)

    def stall_bound_s(self, child: Child) -> float:
        """The router's stall bound for `child` now (its default knobs)."""
        return StallBound().seconds(self.status(child).load.max_step_s)

    def all_routable(self) -> bool:
        children = [*self.local.prefill, *self.local.decode]
        return all(self.status(c).healthy for c in children)

    def nothing_held(self) -> bool:
        urls = self.local.metrics_urls()
        for child in [*self.local.prefill, *self.local.decode]:
            free = scrape(urls[child.name], "pdmesh:kv_cache_free_blocks")
            if free != scrape(urls[child.name], "pdmesh:kv_cache_total_blocks"):
                return False
        return True

    def recovered(self) -> None:
        wait_for(self.all_routable, "every instance routable again", timeout_s=60)
        wait_for(self.nothing_held, "every engine's blocks free", timeout_s=60)

    def migrations(self, reason: str) -> float:
        return scrape(self.local.metrics_urls()["router"], "pdmesh:router_migrations_total",
                      reason=reason)


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    config = MeshConfig(num_prefill=1, num_decode=2, kv_cache_memory="96MiB",
                        local_prefill_threshold=0, routing_policy="round_robin")
    local = LocalMesh(config, router_args=["--migration-limit", "3"])
    local.start()
    try:
        with grpc.insecure_channel(local.router_address) as channel:
            router = router_pb2_grpc.RouterStub(channel)
            mesh = Mesh(local, router, {}, {})
            wait_for(mesh.all_routable, "every instance routable")
            mesh.prompts.update({p: list(router.Tokenize(router_pb2.TokenizeRequest(text=p),
                                                         timeout=30).token_ids)
                                 for p in PROMPTS})
            for ids in mesh.prompts.values():  # the same prefix-cache hits in every run below
                list(router.Generate(router_pb2.GenerateRequest(
                    token_ids=router_pb2.TokenIds(ids=ids),
                    sampling=common_pb2.SamplingParams(temperature=0, max_tokens=1)),
                    timeout=60))
            mesh.reference.update(run_all(local.router_address, mesh.prompts,
                                          list(range(len(REQUESTS)))))
            for stream in mesh.reference.values():
                assert not stream.errors and stream.result is not None
            yield mesh
    finally:
        local.stop()


def assert_like_reference(mesh: Mesh, got: dict[int, Stream], *, same_usage: bool) -> None:
    vocab_size = model_vocab_size(mesh.local.config.model)
    for i, stream in got.items():
        ref = mesh.reference[i]
        assert not stream.errors, f"request {i}: {stream.errors}"
        assert stream.result is not None, f"request {i}: no result"
        assert_same_or_near_tie(REQUESTS[i][1], (ref.tokens, ref.logprobs),
                                (stream.tokens, stream.logprobs), vocab_size, f"request {i}")
        assert {k: f.reason for k, f in stream.finishes.items()} == {
            k: f.reason for k, f in ref.finishes.items()}
        usage, want = stream.result.usage, ref.result.usage
        if same_usage:
            assert usage == want, f"request {i}: usage differs"
        else:
            assert (usage.prompt_tokens, usage.completion_tokens) == (
                want.prompt_tokens, want.completion_tokens), f"request {i}: usage differs"


def assert_paused_at_most(streams: dict[int, Stream], bound_s: float) -> None:
    pauses = {i: round(s.longest_pause_s(), 1) for i, s in streams.items()}
    assert max(pauses.values()) <= bound_s + CONFIRM_S + MOVE_SLACK_S, (
        f"a stream paused longer than the stall bound {bound_s:.1f}s plus a move: {pauses}")


def decode_health(child: Child) -> tuple[int, engine_pb2.EngineLoad]:
    with grpc.insecure_channel(child.address or "") as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5).status
        load = engine_pb2_grpc.DecodeStub(channel).GetLoad(engine_pb2.GetLoadRequest(),
                                                           timeout=5)
    return health, load


def served_by_survivor(mesh: Mesh, victim: Child, survivor: Child) -> None:
    """New requests, while the victim is stopped: all go to the survivor, promptly."""
    survivor_id = mesh.status(survivor).instance_id
    fresh = run_all(mesh.local.router_address, mesh.prompts, [0, 1, 4, 5])
    for i, stream in fresh.items():
        assert not stream.errors and stream.result is not None, f"request {i}: {stream.errors}"
        assert stream.result.served_by.decode_instance_id == survivor_id
        assert stream.result.timing.ttft_ms < 15_000, f"request {i}: slow first token"
    assert not mesh.status(victim).healthy


def test_stopped_decode_core_streams_migrate_and_new_requests_avoid_it(mesh: Mesh) -> None:
    victim, survivor = mesh.local.decode
    bound = mesh.stall_bound_s(victim)
    before = mesh.migrations("stalled")
    with stoppable(core_pid(victim)) as stop:
        stopped: list[float] = []
        got = run_all(mesh.local.router_address, mesh.prompts, list(range(len(REQUESTS))),
                      on_started=lambda: stopped.append(stop()))
        # The service sees its core owe answers: NOT_SERVING, and GetLoad says why.
        health, load = wait_for(lambda: (lambda h: h[1].core_stalled and h)(
            decode_health(victim)), "the victim to report its core stalled", timeout_s=60)
        assert health == health_pb2.HealthCheckResponse.NOT_SERVING
        assert load.core_silent_s >= StallBound().min_s
        assert "stalled" in mesh.status(victim).detail
        served_by_survivor(mesh, victim, survivor)
    assert mesh.migrations("stalled") > before
    assert_like_reference(mesh, got, same_usage=True)
    assert_paused_at_most(got, bound)
    mesh.recovered()
    health, load = decode_health(victim)
    assert health == health_pb2.HealthCheckResponse.SERVING and not load.core_stalled


def test_stopped_decode_service_streams_migrate_and_new_requests_avoid_it(mesh: Mesh) -> None:
    victim, survivor = mesh.local.decode
    bound = mesh.stall_bound_s(victim)
    before = mesh.migrations("stalled")
    with stoppable(victim.pid, core_pid(victim)) as stop:
        got = run_all(mesh.local.router_address, mesh.prompts, list(range(len(REQUESTS))),
                      on_started=stop)
        served_by_survivor(mesh, victim, survivor)
    assert mesh.migrations("stalled") > before
    assert_like_reference(mesh, got, same_usage=True)
    assert_paused_at_most(got, bound)
    mesh.recovered()


def test_stopped_prefill_waiting_requests_prefill_on_their_decode(mesh: Mesh) -> None:
    prefill = mesh.local.prefill[0]
    bound = mesh.stall_bound_s(prefill)
    url = mesh.local.metrics_urls()["router"]
    before = scrape(url, "pdmesh:router_reroutes_total", role="prefill", reason="stalled")
    with stoppable(prefill.pid, core_pid(prefill)) as stop:
        stopped = stop()  # the router still believes in it: these requests go to it and wait
        got = run_all(mesh.local.router_address, mesh.prompts, [0, 1, 2, 3])
        assert not mesh.status(prefill).healthy
    waited = max(stream.arrivals[0] - stopped for stream in got.values())
    assert waited <= bound + CONFIRM_S + MOVE_SLACK_S, (
        f"a first token came {waited:.1f}s after the stop; stall bound {bound:.1f}s")
    assert scrape(url, "pdmesh:router_reroutes_total", role="prefill", reason="stalled") > before
    for stream in got.values():
        assert stream.result is not None
        served = stream.result.served_by
        assert served.prefill_instance_id == served.decode_instance_id  # local prefill
    assert_like_reference(mesh, got, same_usage=False)
    mesh.recovered()
