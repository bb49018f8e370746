"""P/D between engines of different tensor-parallel sizes, in a running mesh (issue 26).

Real processes (redis-server, prefill and decode services with their engine cores and the
cores' other ranks, router; local prefill off, so every prompt's KV moves), SmolLM2 (3 KV
heads: two ranks hold 2 + 1):

1. 1 prefill at TP=2 + 1 decode at TP=1, and 1 prefill at TP=1 + 2 decodes at TP=2: a prompt
   decodes exactly what the offline engine at TP=1 decodes, its KV pulled, not recomputed.
2. In the second mesh, a rank of a decode engine SIGKILLed while streams run on it: its core
   fails, every stream completes on the other decode with the undisturbed run's tokens (a
   divergence only as a float near-tie, tests/near_tie.py), and no engine left holds a block.
   (No shm file of the dead engine's ranks is left: the suite-end check.)
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.serve import Child, LocalMesh, MeshConfig
from pdmesh.v1 import engine_pb2, router_pb2, router_pb2_grpc
from tests.near_tie import assert_same_or_near_tie, model_vocab_size
from tests.polling import wait_for
from tests.router_streams import PROMPTS, Stream, generate_greedy, mixed_sampling, run_stream

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

KV_MEMORY = "64MiB"
MAX_TOKENS = 8
STREAM_TOKENS = 32
PROMPT = ("The history of the printing press begins in the fifteenth century, when a goldsmith "
          "in Mainz combined movable metal type, oil-based ink and a screw press into a system "
          "that could reproduce pages quickly and cheaply. Within fifty years")
LAYOUTS = {"prefill-tp2": (2, 1, 1), "decode-tp2": (1, 2, 2)}  # (prefill TP, decode TP, decodes)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def mesh(request: pytest.FixtureRequest) -> Iterator[LocalMesh]:
    prefill_tp, decode_tp, decodes = LAYOUTS[request.param]
    config = MeshConfig(model="smollm2", num_prefill=1, num_decode=decodes,
                        kv_cache_memory=KV_MEMORY, local_prefill_threshold=0,
                        routing_policy="round_robin", prefill_tensor_parallel_size=prefill_tp,
                        decode_tensor_parallel_size=decode_tp)
    with LocalMesh(config, router_args=["--poll-interval-s", "0.2", "--migration-limit",
                                        "3"]) as local:
        yield local


@pytest.fixture(scope="module")
def offline():
    from pdmesh import LLM

    return LLM("smollm2", kv_cache_memory=KV_MEMORY)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items())
                                   if k == "source")
            out[key] = out.get(key, 0.0) + s.value
    return out


def healthy(router: router_pb2_grpc.RouterStub, role: int) -> list[router_pb2.InstanceStatus]:
    status = router.GetStatus(router_pb2.GetStatusRequest(), timeout=5)
    return [i for i in status.instances if i.role == role and i.healthy]


def wait_routable(mesh: LocalMesh) -> None:
    with grpc.insecure_channel(mesh.router_address) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        wait_for(lambda: len(healthy(router, engine_pb2.ROLE_DECODE)) == len(mesh.decode)
                 and len(healthy(router, engine_pb2.ROLE_PREFILL)) == 1, "the mesh routable")


def generate(mesh: LocalMesh, ids: list[int]) -> tuple[list[int], router_pb2.GenerateResult]:
    return generate_greedy(mesh.router_address, ids, MAX_TOKENS)


def test_a_prompt_moves_between_tensor_parallel_sizes_and_decodes_as_one_rank(
        mesh: LocalMesh, offline) -> None:
    ids = offline.engine.tokenize(PROMPT)[1]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = list(offline.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids)
    wait_routable(mesh)
    urls = mesh.metrics_urls()
    pulled = sum(scrape(urls[d.name]).get("pdmesh:kv_blocks_loaded_total,source=pulled", 0.0)
                 for d in mesh.decode)

    tokens, result = generate(mesh, ids)

    assert result.served_by.prefill_instance_id != result.served_by.decode_instance_id
    assert tokens == want
    after = sum(scrape(urls[d.name]).get("pdmesh:kv_blocks_loaded_total,source=pulled", 0.0)
                for d in mesh.decode)
    assert after - pulled >= -(-len(ids) // 16) - 1  # the KV moved, not recomputed


def rank_processes(child: Child) -> list[psutil.Process]:
    """The engine's ranks other than the core: `pdmesh.engine.core.rank_process` processes
    under the service."""
    return [p for p in psutil.Process(child.pid).children(recursive=True)
            if "pdmesh.engine.core.rank_process" in " ".join(p.cmdline())]


def run_streams(mesh: LocalMesh, prompts: list[list[int]],
                on_started=None) -> list[Stream]:
    params = [mixed_sampling(i, STREAM_TOKENS) for i in range(len(prompts))]
    streams = [Stream() for _ in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(run_stream, mesh.router_address, ids, p, s, started_after=3,
                               timeout_s=240)
                   for ids, p, s in zip(prompts, params, streams, strict=True)]
        if on_started is not None:
            for s in streams:
                assert s.started.wait(timeout=240), "a stream never started"
            on_started()
        return [f.result(timeout=300) for f in futures]


@pytest.mark.parametrize("mesh", ["decode-tp2"], indirect=True)  # two decodes: one survives
def test_a_rank_killed_mid_stream_migrates_the_streams(mesh: LocalMesh) -> None:
    wait_routable(mesh)
    with grpc.insecure_channel(mesh.router_address) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        prompts = [list(router.Tokenize(router_pb2.TokenizeRequest(text=p),
                                        timeout=30).token_ids) for p in PROMPTS[:4]]
    reference = run_streams(mesh, prompts)
    assert all(not r.errors and r.result is not None for r in reference)

    victim, survivor = mesh.decode
    ranks = rank_processes(victim)
    assert len(ranks) == 1  # TP=2: the core and one more rank

    disturbed = run_streams(mesh, prompts, on_started=ranks[0].kill)

    vocab_size = model_vocab_size(mesh.config.model)
    for i, (ref, got) in enumerate(zip(reference, disturbed, strict=True)):
        assert not got.errors, f"request {i}: {got.errors}"
        assert got.result is not None
        assert_same_or_near_tie(mixed_sampling(i, STREAM_TOKENS), (ref.tokens, ref.logprobs),
                                (got.tokens, got.logprobs), vocab_size, f"request {i}")
    urls = mesh.metrics_urls()
    assert scrape(urls["router"]).get("pdmesh:router_migrations_total", 0.0) >= 1

    def nothing_held() -> bool:
        for child in (survivor, mesh.prefill[0]):
            samples = scrape(urls[child.name])
            if samples["pdmesh:kv_cache_free_blocks"] != samples["pdmesh:kv_cache_total_blocks"]:
                return False
        return True

    wait_for(nothing_held, "every surviving engine's blocks free", timeout_s=30)
