"""Faults that used to take a running mesh down quietly (issue 12, items 1 and 5).

One small mesh (redis-server, 1 prefill, 1 decode, router, gateway) as real processes. The
tests run in file order and each leaves the mesh as the next one expects:

1. Redis dies: every engine must stay idle (the presence loop used to retry with a zero wait
   and burn a full core each), report `pdmesh:index_up` 0 — engines and router — and a
   degraded index health, while requests are still served.
2. Redis returns on the same port, empty: every instance registers again and republishes the
   blocks it holds, so `index_up` is 1 again and prefix routing has its data back.
3. The only prefill instance dies: the mesh keeps serving, every prompt prefilled on the decode
   instance (issue 10), and health stays SERVING / 200 (saying it is degraded). Then the only
   decode instance dies too: nothing can be served, so the router's health for
   pdmesh.v1.Router is NOT_SERVING and the gateway's /health answers 503 saying why; a new
   decode instance joining through the registry makes both healthy again.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.engine.block_hash import HashScheme, hash_token_blocks
from pdmesh.engine_svc.presence import PRESENCE_HEALTH_NAME
from pdmesh.kvstore.instance_registry import InstanceRegistry
from pdmesh.kvstore.prefix_index import PrefixIndex
from pdmesh.kvstore.redis_conn import IndexUnavailable, RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace
from pdmesh.kvstore.redis_server import RedisServer
from pdmesh.serve import Child, LocalMesh, MeshConfig, pdmesh_command
from pdmesh.v1 import common_pb2, engine_pb2, router_pb2, router_pb2_grpc
from tests.polling import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

KV_MEMORY = "64MiB"
MODEL = "smollm2"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# A prompt of several full blocks, sent before the outage: its blocks must be back in the
# index after Redis restarts empty.
PROMPT = "Once upon a time, in a quiet village by the sea, there lived an old fisherman " * 3




@dataclass
class Mesh:
    local: LocalMesh
    channel: grpc.Channel
    router: router_pb2_grpc.RouterStub

    @property
    def engines(self) -> list[Child]:
        return [*self.local.prefill, *self.local.decode]

    @property
    def gateway(self) -> str:
        assert self.local.gateway is not None and self.local.gateway.address
        return f"http://{self.local.gateway.address}"

    def status(self) -> router_pb2.RouterStatus:
        return self.router.GetStatus(router_pb2.GetStatusRequest(), timeout=5)

    def router_health(self, service: str) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def generate(self, max_tokens: int = 4, text: str = PROMPT) -> router_pb2.GenerateResult:
        request = router_pb2.GenerateRequest(
            text=text, stream=True,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                               ignore_eos=True),
        )
        responses = list(self.router.Generate(request, timeout=120))
        assert responses and responses[-1].HasField("result")
        return responses[-1].result


def engine_health(child: Child, service: str) -> int:
    with grpc.insecure_channel(child.address or "") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def metric_value(url: str, name: str, **labels: str) -> float | None:
    """The sample `name` (with at least `labels`) served at `url`; None when absent."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return None


def index_up(url: str) -> float | None:
    return metric_value(url, "pdmesh:index_up")


def index_up_everywhere(mesh: Mesh) -> dict[str, float | None]:
    urls = mesh.local.metrics_urls()
    return {name: index_up(urls[name]) for name in [*(c.name for c in mesh.engines), "router"]}


def cpu_seconds(pids: list[int], window_s: float) -> dict[int, float]:
    """CPU (user + system, all threads) each process burns over `window_s`."""
    procs = {pid: psutil.Process(pid) for pid in pids}
    before = {pid: sum(p.cpu_times()[:2]) for pid, p in procs.items()}
    time.sleep(window_s)
    return {pid: sum(p.cpu_times()[:2]) - before[pid] for pid, p in procs.items()}


def redis_state(url: str, hashes: list) -> tuple[set[str], dict[str, int]]:
    """(registered instance ids, leading blocks of `hashes` each holds) in the Redis at url."""

    async def read() -> tuple[set[str], dict[str, int]]:
        conn = RedisConnection.from_url(url)
        keys = KeySpace(MODEL)
        try:
            live = await InstanceRegistry(conn, keys).live_instances()
            held = await PrefixIndex(conn, keys).longest_prefix(hashes)
            return {i.instance_id for i in live}, held
        except IndexUnavailable:
            return set(), {}
        finally:
            await conn.aclose()

    return asyncio.run(read())


@pytest.fixture(name="mesh", scope="module")
def mesh_fixture() -> Iterator[Mesh]:
    config = MeshConfig(
        num_prefill=1, num_decode=1, kv_cache_memory=KV_MEMORY, gateway_port=0,
        local_prefill_threshold=0,  # every prompt needs the prefill instance
    )
    with LocalMesh(config, router_args=["--poll-interval-s", "0.2"]) as local, \
            grpc.insecure_channel(local.router_address) as channel:
        mesh = Mesh(local, channel, router_pb2_grpc.RouterStub(channel))
        wait_for(lambda: len(mesh.status().instances) == 2
                 and all(i.healthy for i in mesh.status().instances), "2 healthy instances")
        yield mesh


@pytest.fixture(name="prompt_hashes", scope="module")
def prompt_hashes_fixture(mesh: Mesh) -> list:
    ids = mesh.router.Tokenize(router_pb2.TokenizeRequest(text=PROMPT), timeout=30).token_ids
    hashes = hash_token_blocks(HashScheme(block_size=16), list(ids))
    assert len(hashes) >= 2
    return hashes


def test_redis_outage_keeps_engines_idle_and_reports_the_index_down(
    mesh: Mesh, prompt_hashes: list
) -> None:
    result = mesh.generate()
    served = {result.served_by.prefill_instance_id, result.served_by.decode_instance_id}
    wait_for(lambda: served <= set(redis_state(mesh.local.redis_url, prompt_hashes)[1]),
             "the prompt's blocks indexed for both instances")
    assert set(index_up_everywhere(mesh).values()) == {1.0}
    pids = [c.pid for c in mesh.engines]
    idle = cpu_seconds(pids, 2.0)

    assert mesh.local.redis is not None
    mesh.local.redis.kill()
    # Engines notice at their next heartbeat (a third of the 10 s TTL), the router at its
    # next registry poll.
    wait_for(lambda: set(index_up_everywhere(mesh).values()) == {0.0},
             "index_up 0 on every engine and the router", timeout_s=15)

    window = 3.0
    burnt = cpu_seconds(pids, window)
    for child in mesh.engines:
        share = burnt[child.pid] / window
        assert share < 0.25, (
            f"{child.name} burns {share:.0%} of a core with Redis down (idle with Redis: "
            f"{idle[child.pid] / 2.0:.0%}): the presence loop spins"
        )

    for child in mesh.engines:  # degraded, not down: the engine still serves
        assert engine_health(child, PRESENCE_HEALTH_NAME) == NOT_SERVING
        assert engine_health(child, "") == SERVING
    assert mesh.router_health("pdmesh.v1.Router") == SERVING
    assert mesh.router_health("pdmesh.router.PrefixIndex") == NOT_SERVING
    assert httpx.get(f"{mesh.gateway}/health", timeout=10).status_code == 200
    status = mesh.status()
    assert not status.prefix_index_available and status.serving

    result = mesh.generate(max_tokens=8)
    assert result.usage.completion_tokens == 8


def test_redis_back_empty_instances_reregister_and_republish(
    mesh: Mesh, prompt_hashes: list
) -> None:
    assert mesh.local.redis is None or not mesh.local.redis.running
    port = int(mesh.local.redis_url.rsplit(":", 1)[1].split("/")[0])
    mesh.local.redis = RedisServer(port=port).start()  # empty: no persistence
    ids = {i.instance_id for i in mesh.status().instances}
    assert len(ids) == 2

    # Back-off is at most 5 s (plus jitter) between tries, then a heartbeat finds the
    # registration gone, registers anew and sends a full snapshot.
    def recovered() -> bool:
        registered, held = redis_state(mesh.local.redis_url, prompt_hashes)
        return registered == ids and all(held.get(i) == len(prompt_hashes) for i in ids)

    wait_for(recovered, "both instances registered with their blocks indexed", timeout_s=30)
    wait_for(lambda: set(index_up_everywhere(mesh).values()) == {1.0},
             "index_up 1 everywhere", timeout_s=15)
    for child in mesh.engines:
        assert engine_health(child, PRESENCE_HEALTH_NAME) == SERVING
    wait_for(lambda: mesh.router_health("pdmesh.router.PrefixIndex") == SERVING,
             "router index health SERVING")
    lookups_ok = metric_value(mesh.local.metrics_urls()["router"],
                              "pdmesh:router_index_lookups_total", outcome="ok") or 0.0
    assert mesh.generate().usage.completion_tokens == 4
    assert metric_value(mesh.local.metrics_urls()["router"],
                        "pdmesh:router_index_lookups_total", outcome="ok") > lookups_ok


def test_without_prefill_decode_prefills_and_503_only_without_decode(mesh: Mesh) -> None:
    assert httpx.get(f"{mesh.gateway}/health", timeout=10).status_code == 200
    assert mesh.status().serving
    mesh.local.prefill[0].kill()

    # The only prefill instance is gone: degraded, still serving (decode prefills).
    wait_for(lambda: not next(i for i in mesh.status().instances
                              if i.role == engine_pb2.ROLE_PREFILL).healthy,
             "the dead prefill out of routing", timeout_s=15)
    assert httpx.get(f"{mesh.gateway}/health", timeout=10).status_code == 200
    assert mesh.router_health("pdmesh.v1.Router") == SERVING
    status = mesh.status()
    assert status.serving and "no live prefill instance" in status.serving_detail
    result = mesh.generate()
    assert result.usage.completion_tokens == 4
    assert result.served_by.prefill_instance_id == result.served_by.decode_instance_id
    completion = httpx.post(f"{mesh.gateway}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert completion.status_code == 200, completion.text

    # No decode-capable instance either: now nothing can be served.
    mesh.local.decode[0].kill()

    def gateway_unhealthy() -> httpx.Response | None:
        resp = httpx.get(f"{mesh.gateway}/health", timeout=10)
        return resp if resp.status_code == 503 else None

    resp = wait_for(gateway_unhealthy, "gateway /health 503", timeout_s=15)
    body = resp.json()
    assert body["status"] == "unavailable"
    assert "decode" in body["reason"], body
    assert mesh.router_health("pdmesh.v1.Router") == NOT_SERVING
    assert mesh.router_health("") == SERVING  # the process is fine: liveness must not fail
    status = mesh.status()
    assert not status.serving and "decode" in status.serving_detail
    # What health says is what requests get.
    with pytest.raises(grpc.RpcError) as info:
        mesh.generate()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    completion = httpx.post(f"{mesh.gateway}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert completion.status_code == 503

    # A new decode instance joins through the registry: serving again, still without prefill.
    fresh = Child("decode-new", pdmesh_command("decode", *mesh.local.engine_args("decode")))
    try:
        fresh.wait_ready(timeout_s=180)
        wait_for(lambda: httpx.get(f"{mesh.gateway}/health", timeout=10).status_code == 200,
                 "gateway /health 200 again", timeout_s=30)
        assert mesh.router_health("pdmesh.v1.Router") == SERVING
        assert mesh.status().serving
        assert mesh.generate().usage.completion_tokens == 4
    finally:
        fresh.terminate()
