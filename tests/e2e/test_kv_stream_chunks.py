"""P/D with the KV streamed by prefill chunk, in a running mesh (issue 23, "Streamed by chunk").

A small mesh as real processes (redis-server, 1 prefill, 1 decode, router; local prefill off,
so every prompt's KV moves), every engine prefilling in chunks of 32 tokens: the router asks
the prefill instance for `PrefillStream` and starts Decode at its first message, so the
decode instance pulls each chunk's blocks while the next chunk computes.

1. A prompt of many chunks decodes exactly what the offline engine (colocated) decodes, and
   the decode instance's `pdmesh:kv_stream_blocks_total{phase="before_seal"}` says blocks were
   pulled before the prefill ended.
2. The prefill process SIGKILLed while it computes the prompt's chunks: the request completes
   with the same tokens (re-planned: the decode instance prefills it), and the decode's KV
   blocks all come back. (No shm segment of the dead process is left: the suite-end check.)

Both again with the router's `--no-kv-stream-chunks` (Prefill, then Decode: nothing streamed).
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.serve import Child, LocalMesh, MeshConfig
from pdmesh.v1 import router_pb2
from tests.mesh_calls import engine_load, wait_routable
from tests.polling import wait_for
from tests.router_streams import generate_greedy

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

CHUNK = 32
MAX_TOKENS = 8
KV_MEMORY = "64MiB"
STORY = ("A lighthouse keeper on a remote northern island kept a logbook of every ship that "
         "passed, every storm that broke against the rocks and every bird that rested on the "
         "gallery rail. After forty years the logbooks filled a whole shelf, and when a "
         "historian finally read them she found a record of the weather, the sea and the "
         "people of the island that no archive on the mainland had kept. ")


def prompt(variant: str, repeats: int) -> str:
    return f"{variant}: " + STORY * repeats + "She wrote to the keeper's grandson to ask whether"


def metric(child: Child | str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples with at least `labels` at a child's (or a URL's) metrics."""
    url = child if isinstance(child, str) else child.metrics_url
    assert url
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


@pytest.fixture(scope="module", params=["streamed", "unary"])
def mesh(request: pytest.FixtureRequest) -> Iterator[LocalMesh]:
    config = MeshConfig(model="smollm2", num_prefill=1, num_decode=1, kv_cache_memory=KV_MEMORY,
                        local_prefill_threshold=0,
                        engine=EngineConfig(max_num_batched_tokens=CHUNK))
    flags = [] if request.param == "streamed" else ["--no-kv-stream-chunks"]
    local = LocalMesh(config, router_args=["--poll-interval-s", "0.2", *flags])
    local.streamed = request.param == "streamed"  # type: ignore[attr-defined]
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def offline():
    from pdmesh import LLM

    return LLM("smollm2", kv_cache_memory=KV_MEMORY)


def colocated(llm, ids: list[int]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return list(llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids)


def generate(mesh: LocalMesh, ids: list[int]) -> tuple[list[int], router_pb2.GenerateResult]:
    return generate_greedy(mesh.router_address, ids, MAX_TOKENS)


def test_streamed_prompt_equals_colocated_and_pulls_before_the_seal(mesh, offline) -> None:
    ids = offline.engine.tokenize(prompt("streamed", 4))[1]
    assert len(ids) > 8 * CHUNK  # many chunks
    want = colocated(offline, ids)
    decode = mesh.decode[0]
    wait_routable(mesh.router_address, 2)
    before = metric(decode, "pdmesh:kv_stream_blocks_total", phase="before_seal")

    tokens, result = generate(mesh, ids)

    assert result.served_by.prefill_instance_id != result.served_by.decode_instance_id
    assert tokens == want
    after = metric(decode, "pdmesh:kv_stream_blocks_total", phase="before_seal")
    assert after > before if mesh.streamed else after == before
    pulled = metric(decode, "pdmesh:kv_blocks_loaded_total", source="pulled")
    assert pulled >= -(-len(ids) // 16) - 1


def test_prefill_killed_mid_prompt_completes_with_the_same_tokens(mesh, offline) -> None:
    ids = offline.engine.tokenize(prompt("killed", 8))[1]
    want = colocated(offline, ids)
    prefill, decode = mesh.prefill[0], mesh.decode[0]
    wait_routable(mesh.router_address, 2)
    total = engine_load(decode, "decode").num_total_blocks
    router_url = mesh.metrics_urls()["router"]
    reroutes = metric(router_url, "pdmesh:router_reroutes_total", role="prefill")

    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = generate(mesh, ids)
        except Exception as exc:  # reported by the assertion below
            outcome["error"] = exc

    client = threading.Thread(target=run)
    client.start()
    # The prompt is being prefilled (and streamed): its prefill is running on the instance.
    wait_for(lambda: engine_load(prefill, "prefill").num_running >= 1,
             "the prefill computes the prompt", interval_s=0.01)
    prefill.kill()
    client.join(timeout=300)
    assert not client.is_alive()
    assert "error" not in outcome, outcome.get("error")
    tokens, result = outcome["value"]  # type: ignore[misc]
    assert tokens == want  # re-planned: the decode instance prefilled it, same tokens
    served = result.served_by
    assert served.prefill_instance_id == served.decode_instance_id  # a local prefill
    assert metric(router_url, "pdmesh:router_reroutes_total", role="prefill") > reroutes
    wait_for(lambda: engine_load(decode, "decode").num_free_blocks == total,
             "the decode's blocks all free")
