"""KV moves worker to worker in a running mesh (issue: "KV moves worker to worker").

A small mesh as real processes (redis-server, 1 prefill, 1 decode, router; local prefill off,
so every prompt's KV moves), once per core transport (shm, tcp, torch_dist): the decode
instance's engine core pulls the prompt's blocks itself from the prefill's core, only those its
own prefix cache lacks. A decode instance that holds
the first half of a prompt (it served that half before) pulls only the other half, and the
tokens equal the offline engine's (colocated) token for token; the metrics say how many
blocks were pulled and how many reused.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.kvstore.transfer.backends.availability import ucxx_unavailable_reason
from pdmesh.serve import Child, LocalMesh, MeshConfig
from pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from tests.polling import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

BLOCK = 16
MAX_TOKENS = 8
PROMPT = ("A lighthouse keeper on a remote northern island kept a logbook of every ship that "
          "passed, every storm that broke against the rocks and every bird that rested on the "
          "gallery rail. After forty years the logbooks filled a whole shelf, and when a "
          "historian finally read them she found a record of the weather, the sea and the "
          "people of the island that no archive on the mainland had kept. She copied the "
          "entries by hand through a whole winter, and in spring she wrote to the keeper's "
          "grandson to ask whether")


def blocks_loaded(child: Child) -> dict[str, float]:
    assert child.metrics_url
    with urllib.request.urlopen(child.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdmesh:kv_blocks_loaded_total":
                source = sample.labels["source"]
                out[source] = out.get(source, 0.0) + sample.value
    return out


@pytest.fixture(scope="module", params=[
    "auto", "tcp", "torch_dist",
    pytest.param("ucxx", marks=pytest.mark.skipif(ucxx_unavailable_reason() is not None,
                                                  reason="needs the ucxx package"))])
def mesh(request: pytest.FixtureRequest) -> Iterator[LocalMesh]:
    """auto: same host, so the decode core copies out of the prefill core's cache file (shm);
    tcp: the prefill core's block server; torch_dist: a gloo group the two cores keep; ucxx: the
    prefill core's ucxx listener."""
    config = MeshConfig(model="smollm2", num_prefill=1, num_decode=1, kv_cache_memory="64MiB",
                        local_prefill_threshold=0, kv_backend=request.param)
    local = LocalMesh(config, router_args=["--poll-interval-s", "0.2"])
    local.start()
    try:
        yield local
    finally:
        local.stop()


def greedy() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_decode_holding_half_the_prompt_pulls_only_the_rest(mesh: LocalMesh) -> None:
    from pdmesh import LLM

    llm = LLM("smollm2", kv_cache_memory="64MiB")
    ids = llm.engine.tokenize(PROMPT)[1]
    want = list(llm.generate([{"prompt_token_ids": ids}],
                             SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                            ignore_eos=True))[0].outputs[0].token_ids)
    half = ids[: (len(ids) // (2 * BLOCK)) * BLOCK]
    assert len(half) >= 2 * BLOCK
    decode = mesh.decode[0]
    assert decode.address

    # The decode instance serves the first half on its own (no remote prefill): its prefix
    # cache now holds those blocks.
    with grpc.insecure_channel(decode.address) as channel:
        stub = engine_pb2_grpc.DecodeStub(channel)
        warm = engine_pb2.DecodeRequest(request_id="warm-half", prompt_token_ids=half,
                                        sampling=common_pb2.SamplingParams(
                                            temperature=0.0, max_tokens=1))
        assert any(r.HasField("result") for r in stub.Decode(warm, timeout=60))
    before = blocks_loaded(decode)

    with grpc.insecure_channel(mesh.router_address) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        wait_for(lambda: sum(i.healthy for i in router.GetStatus(
            router_pb2.GetStatusRequest(), timeout=5).instances) >= 2, "both instances routable")
        request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                             sampling=greedy())
        replies = list(router.Generate(request, timeout=120))
    tokens = [t for r in replies if r.HasField("delta") for t in r.delta.token_ids]
    final = next(r.result for r in replies if r.HasField("result"))
    assert final.served_by.prefill_instance_id != final.served_by.decode_instance_id
    assert tokens == want

    after = blocks_loaded(decode)
    num_blocks = -(-len(ids) // BLOCK)
    reused = after.get("reused", 0) - before.get("reused", 0)
    pulled = after.get("pulled", 0) - before.get("pulled", 0)
    assert reused == len(half) // BLOCK
    assert pulled == num_blocks - reused
