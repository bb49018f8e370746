"""n > 1 requests against a small KV pool, through a real mesh (router + 1 prefill + 1 decode).

Regression for "KV cache full: no room to fork the imported request": concurrent `n > 1`
requests whose forks did not fit *right now* failed and left their forked children "running"
with their blocks, forever. Now:

* a request that can never fit a decode instance's KV pool (n x (prompt + max_tokens), prompt
  blocks shared) is refused up front with RESOURCE_EXHAUSTED, by the router and, as the
  authority, by the decode engine itself;
* forks that do not fit right now wait in the engine's scheduler and finish;
* after every failure path (client cancel, deadline) every block is back in the pool and
  nothing is left running, and a small follow-up request completes promptly.

Sizes are derived from the instances' own figures (block count, block size), so the test holds
whatever dtype the engines pick.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.serve import LocalMesh, MeshConfig
from pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from tests.polling import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

KV_MEMORY = "8MiB"  # about 11 blocks of 16 tokens for SmolLM2-135M in fp32
PROMPT = "The history of the old stone bridge in our town begins in the twelfth century, when"
MAX_TOKENS = 6




def request_blocks(num_prompt: int, max_tokens: int, n: int, block_size: int) -> int:
    """Blocks an n-sample request holds at its peak: shared prompt blocks + each sample's own."""
    shared = num_prompt // block_size
    return shared + n * (-(-(num_prompt + max_tokens) // block_size) - shared)


@dataclass
class Mesh:
    local: LocalMesh
    router: router_pb2_grpc.RouterStub
    decode_address: str
    prefill_address: str
    num_prompt: int
    block_size: int
    total_blocks: int

    def decode_load(self) -> engine_pb2.EngineLoad:
        with grpc.insecure_channel(self.decode_address) as channel:
            stub = engine_pb2_grpc.DecodeStub(channel)
            return stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)

    def prefill_load(self) -> engine_pb2.EngineLoad:
        with grpc.insecure_channel(self.prefill_address) as channel:
            stub = engine_pb2_grpc.PrefillStub(channel)
            return stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)

    def fits(self, n: int) -> bool:
        need = request_blocks(self.num_prompt, MAX_TOKENS, n, self.block_size)
        return need <= self.total_blocks


@pytest.fixture(name="mesh", scope="module")
def mesh_fixture() -> Iterator[Mesh]:
    config = MeshConfig(num_prefill=1, num_decode=1, kv_cache_memory=KV_MEMORY,
                        local_prefill_threshold=0, gateway_port=-1)
    with LocalMesh(config, router_args=["--poll-interval-s", "0.2"]) as local, \
            grpc.insecure_channel(local.router_address) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        wait_for(lambda: [i.healthy for i in router.GetStatus(
            router_pb2.GetStatusRequest(), timeout=5).instances] == [True, True],
            "2 healthy instances")
        ids = router.Tokenize(router_pb2.TokenizeRequest(text=PROMPT), timeout=10).token_ids
        decode, prefill = local.decode[0].address, local.prefill[0].address
        assert decode and prefill
        with grpc.insecure_channel(decode) as dchannel:
            info = engine_pb2_grpc.DecodeStub(dchannel).GetInfo(
                engine_pb2.GetInfoRequest(), timeout=5)
        yield Mesh(local, router, decode, prefill, len(ids), info.block_size,
                   info.kv_capacity_tokens // info.block_size)


def sampling(n: int, max_tokens: int = MAX_TOKENS) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=1.0, seed=7, n=n, max_tokens=max_tokens,
                                     ignore_eos=True)


def all_free(mesh: Mesh) -> bool:
    d, p = mesh.decode_load(), mesh.prefill_load()
    return (d.num_free_blocks == d.num_total_blocks and d.num_running == 0
            and d.num_waiting == 0 and p.num_free_blocks == p.num_total_blocks
            and p.num_running == 0)


def wait_all_free(mesh: Mesh, what: str, timeout_s: float) -> None:
    """`all_free` within `timeout_s`; else fail saying what each instance still holds."""
    try:
        wait_for(lambda: all_free(mesh), what, timeout_s=timeout_s)
    except AssertionError as exc:
        d, p = mesh.decode_load(), mesh.prefill_load()
        raise AssertionError(
            f"{exc}\ndecode: {d.num_running} running, {d.num_waiting} waiting, "
            f"{d.num_free_blocks}/{d.num_total_blocks} blocks free; prefill: {p.num_running} "
            f"running, {p.num_free_blocks}/{p.num_total_blocks} blocks free") from None


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def test_a_request_that_can_never_fit_is_refused_before_anything_runs(mesh: Mesh) -> None:
    n = next(n for n in range(2, 1000) if not mesh.fits(n))
    with pytest.raises(grpc.RpcError) as err:
        list(mesh.router.Generate(router_pb2.GenerateRequest(
            request_id="too-big-router", text=PROMPT, sampling=sampling(n)), timeout=60))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    assert "KV" in err.value.details() and f"n={n}" in err.value.details(), err.value.details()

    # The engine is the authority: straight to the decode instance, it refuses too.
    ids = mesh.router.Tokenize(router_pb2.TokenizeRequest(text=PROMPT), timeout=10).token_ids
    with grpc.insecure_channel(mesh.decode_address) as channel, \
            pytest.raises(grpc.RpcError) as err:
        list(engine_pb2_grpc.DecodeStub(channel).Decode(engine_pb2.DecodeRequest(
            request_id="too-big-decode", prompt_token_ids=ids, sampling=sampling(n)),
            timeout=60))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    assert "KV" in err.value.details(), err.value.details()
    wait_all_free(mesh, "every block free after the refusals", timeout_s=15)


async def _generate(stub: router_pb2_grpc.RouterStub, request_id: str, n: int, *,
                    timeout_s: float, cancel_after_first: bool = False
                    ) -> tuple[grpc.StatusCode, list[common_pb2.SequenceDelta]]:
    call = stub.Generate(router_pb2.GenerateRequest(
        request_id=request_id, text=PROMPT, sampling=sampling(n), stream=True),
        timeout=timeout_s)
    deltas: list[common_pb2.SequenceDelta] = []
    try:
        async for resp in call:
            if resp.HasField("delta"):
                deltas.append(resp.delta)
                if cancel_after_first:
                    call.cancel()
                    return grpc.StatusCode.CANCELLED, deltas
    except grpc.aio.AioRpcError as exc:
        return exc.code(), deltas
    return grpc.StatusCode.OK, deltas


def test_concurrent_forks_wait_and_every_failure_path_frees_all_blocks(mesh: Mesh) -> None:
    # Largest n whose request fits alone; two of them at once do not fit.
    n = max(n for n in range(2, 1000) if mesh.fits(n))
    assert 2 * request_blocks(mesh.num_prompt, MAX_TOKENS, n, mesh.block_size) > \
        mesh.total_blocks
    assert all_free(mesh)

    async def run() -> list[tuple[grpc.StatusCode, list[common_pb2.SequenceDelta]]]:
        async with grpc.aio.insecure_channel(mesh.local.router_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            calls = [_generate(stub, f"ok-{i}", n, timeout_s=120) for i in range(5)]
            calls += [_generate(stub, f"late-{i}", n, timeout_s=0.2 + 0.3 * i)
                      for i in range(3)]
            calls += [_generate(stub, f"gone-{i}", n, timeout_s=120, cancel_after_first=True)
                      for i in range(2)]
            return await asyncio.gather(*calls)

    results = asyncio.run(run())
    for i, (code, deltas) in enumerate(results[:5]):
        assert code == grpc.StatusCode.OK, f"ok-{i}: {code}"
        finishes = [d.finish for d in deltas if d.HasField("finish")]
        assert len(finishes) == n, f"ok-{i}: {len(finishes)} finishes for n={n}"
        errors = [f.message for f in finishes if f.reason == common_pb2.FINISH_REASON_ERROR]
        assert not errors, f"ok-{i}: {errors[0]}"
        for index in range(n):
            assert sum(len(d.token_ids) for d in deltas if d.index == index) == MAX_TOKENS
    for code, _ in results[5:8]:
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED), code

    wait_all_free(mesh, "every block free, nothing running", timeout_s=30)
    decode_metrics = mesh.local.metrics_urls()["decode-0"]
    samples = scrape(decode_metrics)
    assert samples["pdmesh:kv_cache_free_blocks"] == mesh.total_blocks, samples
    assert samples["pdmesh:num_requests_running"] == 0, samples

    # The decode instance still serves: a small follow-up finishes quickly.
    started = time.monotonic()
    resp = list(mesh.router.Generate(router_pb2.GenerateRequest(
        request_id="follow-up", text=PROMPT,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)),
        timeout=30))
    assert sum(len(r.delta.token_ids) for r in resp if r.HasField("delta")) == 3
    assert time.monotonic() - started < 30
    wait_all_free(mesh, "every block free after the follow-up", timeout_s=15)


def test_clients_that_leave_at_their_first_token_leave_nothing_behind(mesh: Mesh) -> None:
    """Regressions, each hit by a few in a hundred such clients:

    * one that left while the router handed the prefill's first tokens to the streamed
      Decode call (`Decode.PrefillDone`) left that call waiting for them until its deadline,
      holding its blocks on both instances;
    * an aborted request whose pulled blocks the decode core dropped with no step to run
      after was reported waiting, its blocks taken, until the core's next command.
    """
    assert all_free(mesh)

    async def run() -> list[grpc.StatusCode]:
        codes = []
        async with grpc.aio.insecure_channel(mesh.local.router_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            for wave in range(10):
                results = await asyncio.gather(*[
                    _generate(stub, f"leave-{wave}-{i}", 1, timeout_s=120,
                              cancel_after_first=True) for i in range(4)])
                codes += [code for code, _ in results]
        return codes

    assert set(asyncio.run(run())) == {grpc.StatusCode.CANCELLED}
    wait_all_free(mesh, "every block free, nothing running", timeout_s=15)
