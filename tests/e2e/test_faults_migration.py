"""Decode migration: SIGKILL a decode instance while 8 streams are in flight, and every stream
completes on the other decode instance exactly as it would have without the kill.

One mesh (1 prefill + 2 decode, real processes, Redis and weights; local prefill off so KV
really moves; round-robin routing so both decodes serve streams). The same 8 requests (greedy
and seeded mixed, one with n = 2) run once undisturbed — the reference — and once more with the
decode instance killed when every stream has received a few tokens. Each stream of the second
run must carry the reference's tokens, text, finish reasons and usage: no duplicate, missing or
reordered token, no error event. Afterwards the surviving engines hold no block.

The two runs batch differently, and float32 logits move by ~1e-5 with the batch, so a stream
may legitimately part from the reference where two candidates are that close: such a divergence
is accepted only when it is a near-tie under the request's own sampling (tests/near_tie.py);
a lost, duplicated or misaligned token or a random stream resumed at the wrong draw is not.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.serve import LocalMesh, MeshConfig
from pdmesh.v1 import common_pb2, engine_pb2, router_pb2, router_pb2_grpc
from tests.near_tie import assert_same_or_near_tie, model_vocab_size
from tests.polling import wait_for
from tests.router_streams import PROMPTS, Stream, mixed_requests, run_stream

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

MAX_TOKENS = 64
KILL_AFTER_TOKENS = 3  # every stream has at least this many tokens when the decode dies

REQUESTS = mixed_requests(MAX_TOKENS)


def run_all(address: str, prompts: dict[str, list[int]],
            on_started: Callable[[list[Stream]], None] | None = None) -> list[Stream]:
    streams = [Stream() for _ in REQUESTS]
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        futures = [pool.submit(run_stream, address, prompts[prompt], params, stream,
                               started_after=KILL_AFTER_TOKENS, timeout_s=180)
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


@pytest.fixture()
def mesh() -> Iterator[LocalMesh]:
    config = MeshConfig(num_prefill=1, num_decode=2, kv_cache_memory="96MiB",
                        local_prefill_threshold=0, routing_policy="round_robin")
    local = LocalMesh(config, router_args=["--migration-limit", "3"])
    local.start()
    try:
        yield local
    finally:
        local.stop()


def test_sigkill_decode_mid_stream_every_stream_completes_exactly(mesh: LocalMesh) -> None:
    with grpc.insecure_channel(mesh.router_address) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        wait_for(lambda: len(healthy_decodes(router)) == 2, "2 healthy decodes")
        prompts = {p: list(router.Tokenize(router_pb2.TokenizeRequest(text=p),
                                           timeout=30).token_ids) for p in PROMPTS}
        # Warm the prefill instance's prefix cache so both runs below see the same hits.
        for ids in prompts.values():
            list(router.Generate(router_pb2.GenerateRequest(
                token_ids=router_pb2.TokenIds(ids=ids),
                sampling=common_pb2.SamplingParams(temperature=0, max_tokens=1)), timeout=60))
        reference = run_all(mesh.router_address, prompts)
        for ref in reference:
            assert not ref.errors and ref.result is not None

        victim, survivor = mesh.decode[0], mesh.decode[1]
        killed: list[dict[int, int]] = []

        def kill(streams: list[Stream]) -> None:
            killed.append({i: sum(map(len, s.tokens.values())) for i, s in enumerate(streams)
                           if len(s.finishes) < len(s.tokens)})
            victim.kill()

        disturbed = run_all(mesh.router_address, prompts, on_started=kill)

        survivor_id = next(i.instance_id for i in healthy_decodes(router)
                           if i.address == survivor.address)
    assert killed and len(killed[0]) >= 4, f"too few streams still running at the kill: {killed}"
    vocab_size = model_vocab_size(mesh.config.model)
    for i, (ref, got) in enumerate(zip(reference, disturbed, strict=True)):
        assert not got.errors, f"request {i}: {got.errors}"
        assert got.result is not None, f"request {i}: no result"
        parted = assert_same_or_near_tie(REQUESTS[i][1], (ref.tokens, ref.logprobs),
                                         (got.tokens, got.logprobs), vocab_size,
                                         f"request {i}")
        for index in ref.text.keys() - parted:
            assert got.text[index] == ref.text[index], f"request {i} sequence {index}: text"
        assert {k: (f.reason, f.WhichOneof("stop_reason")) for k, f in got.finishes.items()} == {
            k: (f.reason, f.WhichOneof("stop_reason")) for k, f in ref.finishes.items()}
        assert got.result.usage == ref.result.usage, f"request {i}: usage differs"
        assert got.result.served_by.decode_instance_id == survivor_id

    urls = mesh.metrics_urls()
    migrations = scrape(urls["router"]).get("pdmesh:router_migrations_total", 0.0)
    # Round robin puts about half of the streams on the victim; each of those migrates once.
    assert 1 <= migrations <= len(killed[0]), (migrations, killed)

    def nothing_held() -> bool:
        for name in (survivor.name, mesh.prefill[0].name):
            samples = scrape(urls[name])
            if samples["pdmesh:kv_cache_free_blocks"] != samples["pdmesh:kv_cache_total_blocks"]:
                return False
        return True

    wait_for(nothing_held, "every surviving engine's blocks free", timeout_s=30)
