"""The whole mesh as real processes on 127.0.0.1: router, prefill, decode and redis-server.

One module-scoped mesh (2 prefill, 2 decode, a prefix-aware router and a round-robin router
over the same instances) serves most tests; they run in file order and the destructive ones
(Redis stopped, a decode killed) come last. The mTLS test starts its own small mesh through
`pdmesh serve` first, before the big one exists, to keep this 2-core box from thrashing.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.engine.block_hash import HashScheme, hash_token_blocks
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.kvstore.prefix_index import PrefixIndex
from pdmesh.kvstore.redis_conn import RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace
from pdmesh.serve import Child, LocalMesh, MeshConfig, pdmesh_command
from pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from tests.polling import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

MAX_TOKENS = 10
PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "Paris is the capital of",
]
KV_MEMORY = "96MiB"




def greedy(max_tokens: int = MAX_TOKENS, **kwargs: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


@dataclass
class Outcome:
    token_ids: list[int]
    text: str
    finish: common_pb2.Finish | None
    result: router_pb2.GenerateResult | None


def collect(stream: Iterator[router_pb2.GenerateResponse]) -> Outcome:
    """Concatenate the deltas of sequence 0 and keep the result."""
    out = Outcome([], "", None, None)
    for resp in stream:
        if resp.HasField("delta"):
            assert resp.delta.index == 0
            out.token_ids += resp.delta.token_ids
            out.text += resp.delta.text
            if resp.delta.HasField("finish"):
                assert out.finish is None, "finish sent twice"
                out.finish = resp.delta.finish
        else:
            assert out.result is None, "two results"
            out.result = resp.result
    return out


def generate(
    stub: router_pb2_grpc.RouterStub, timeout_s: float = 120.0, **request: object
) -> Outcome:
    return collect(stub.Generate(router_pb2.GenerateRequest(**request), timeout=timeout_s))


def engine_load(address: str, role: str) -> engine_pb2.EngineLoad:
    with grpc.insecure_channel(address) as channel:
        stub_cls = engine_pb2_grpc.PrefillStub if role == "prefill" else engine_pb2_grpc.DecodeStub
        return stub_cls(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=5)


# -- mTLS (its own mesh, started first) ----------------------------------------------------------
def _write_certs(directory: Path) -> dict[str, Path]:
    """A CA, one cert for every service (server + client use) and a rogue client cert."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def make(name: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer[0].subject if issuer else subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        if issuer is None:
            builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        else:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                False,
            ).add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                False,
            )
        cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
        return cert, key

    ca = make("pdmesh test CA", None)
    service = make("pdmesh service", ca)
    rogue_ca = make("rogue CA", None)
    rogue = make("rogue client", rogue_ca)
    paths: dict[str, Path] = {}
    for name, (cert, key) in {"ca": ca, "service": service, "rogue": rogue}.items():
        paths[f"{name}_cert"] = directory / f"{name}.crt"
        paths[f"{name}_key"] = directory / f"{name}.key"
        paths[f"{name}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{name}_key"].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return paths


def test_mtls_mesh_serves_and_refuses_clients_without_a_valid_cert(tmp_path: Path) -> None:
    certs = _write_certs(tmp_path)
    tls = [
        "--tls-cert", str(certs["service_cert"]), "--tls-key", str(certs["service_key"]),
        "--tls-ca", str(certs["ca_cert"]),
    ]  # fmt: skip
    serve = Child(
        "serve",
        pdmesh_command("serve", "--num-prefill", "1", "--num-decode", "1",
                       "--kv-cache-memory", KV_MEMORY, "--gateway-port", "-1", *tls),
    )
    try:
        address = serve.wait_ready(timeout_s=180)
        ca = certs["ca_cert"].read_bytes()
        good = grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=certs["service_key"].read_bytes(),
            certificate_chain=certs["service_cert"].read_bytes(),
        )
        with grpc.secure_channel(address, good) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            out = generate(stub, text=PROMPTS[0], sampling=greedy(4))
            assert len(out.token_ids) == 4
            assert out.result is not None
            # A short prompt is below the default local-prefill threshold: decode prefills.
            served = out.result.served_by
            assert served.prefill_instance_id == served.decode_instance_id != ""

        rogue = grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=certs["rogue_key"].read_bytes(),
            certificate_chain=certs["rogue_cert"].read_bytes(),
        )
        no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
        for creds in (rogue, no_cert):
            with grpc.secure_channel(address, creds) as channel:
                with pytest.raises(grpc.RpcError) as info:
                    router_pb2_grpc.RouterStub(channel).ListModels(
                        router_pb2.ListModelsRequest(), timeout=10
                    )
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError):
            router_pb2_grpc.RouterStub(channel).ListModels(
                router_pb2.ListModelsRequest(), timeout=10
            )
    finally:
        serve.terminate(grace_s=30)
    assert serve.proc.returncode == 0


# -- the shared mesh -----------------------------------------------------------------------------
@dataclass
class Mesh:
    local: LocalMesh
    router: router_pb2_grpc.RouterStub
    rr_router: router_pb2_grpc.RouterStub
    status: Callable[[], router_pb2.RouterStatus]
    channel: grpc.Channel


@pytest.fixture(name="mesh", scope="module")
def mesh_fixture() -> Iterator[Mesh]:
    config = MeshConfig(
        num_prefill=2, num_decode=2, kv_cache_memory=KV_MEMORY, local_prefill_threshold=0,
        gateway_port=-1,
    )
    fast_polls = ["--poll-interval-s", "0.2"]
    with LocalMesh(config, router_args=fast_polls) as local:
        rr = Child("rr-router", pdmesh_command("router", *local._router_argv(),
                                               "--routing-policy", "round_robin"))
        try:
            rr_address = rr.wait_ready(timeout_s=120)
            with grpc.insecure_channel(local.router_address) as channel, \
                    grpc.insecure_channel(rr_address) as rr_channel:
                router = router_pb2_grpc.RouterStub(channel)

                def status() -> router_pb2.RouterStatus:
                    return router.GetStatus(router_pb2.GetStatusRequest(), timeout=5)

                wait_for(lambda: all(i.healthy for i in status().instances)
                         and len(status().instances) == 4, "4 healthy instances")
                yield Mesh(local, router, router_pb2_grpc.RouterStub(rr_channel), status, channel)
        finally:
            rr.terminate()


@pytest.fixture(name="reference", scope="module")
def reference_fixture() -> dict[str, tuple[list[int], str]]:
    """Greedy outputs of the offline engine, the ground truth the mesh must reproduce."""
    from pdmesh import LLM

    llm = LLM("smollm2", kv_cache_memory=KV_MEMORY)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return {p: (list(o.outputs[0].token_ids), o.outputs[0].text) for p, o in zip(
        PROMPTS, outs, strict=True)}


def test_greedy_output_equals_offline_llm_and_kv_bytes_move(
    mesh: Mesh, reference: dict[str, tuple[list[int], str]]
) -> None:
    def total(field: str, children: list[Child], role: str) -> int:
        return sum(getattr(engine_load(c.address or "", role), field) for c in children)

    sent_before = total("kv_bytes_sent", mesh.local.prefill, "prefill")
    for stream in (True, False):
        for prompt in PROMPTS:
            out = generate(mesh.router, text=prompt, sampling=greedy(), stream=stream)
            assert (out.token_ids, out.text) == reference[prompt], (prompt, stream)
            assert out.finish is not None and out.finish.reason == common_pb2.FINISH_REASON_LENGTH
            assert out.result is not None
            usage = out.result.usage
            assert usage.completion_tokens == MAX_TOKENS
            assert usage.prompt_tokens > 0
            served = out.result.served_by
            assert served.prefill_instance_id.startswith("prefill-")  # threshold 0: remote
            assert served.decode_instance_id.startswith("decode-")
    sent = total("kv_bytes_sent", mesh.local.prefill, "prefill")
    received = total("kv_bytes_received", mesh.local.decode, "decode")
    assert sent - sent_before > 0
    assert sent == received  # every byte that left a prefill arrived at a decode


def test_an_accepted_event_comes_first_when_asked(
    mesh: Mesh, reference: dict[str, tuple[list[int], str]]
) -> None:
    """`send_accepted` (the gateway's, with --sse-keep-alive-interval): an Accepted event
    first, then the same output; a request refused in validation gets its status and no
    Accepted."""
    prompt = PROMPTS[0]
    responses = list(mesh.router.Generate(router_pb2.GenerateRequest(
        text=prompt, sampling=greedy(), stream=True, send_accepted=True), timeout=120))
    assert responses[0].HasField("accepted")
    assert not any(r.HasField("accepted") for r in responses[1:])
    out = collect(iter(responses[1:]))
    assert (out.token_ids, out.text) == reference[prompt]
    seen: list[router_pb2.GenerateResponse] = []
    with pytest.raises(grpc.RpcError) as info:
        for response in mesh.router.Generate(router_pb2.GenerateRequest(
                text="hi", sampling=common_pb2.SamplingParams(top_p=2.0), stream=True,
                send_accepted=True), timeout=60):
            seen.append(response)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and not seen


def test_admission_errors_name_the_field(mesh: Mesh) -> None:
    cases = [
        ({"text": "hi", "sampling": common_pb2.SamplingParams(top_p=2.0)}, "top_p"),
        ({"token_ids": router_pb2.TokenIds(ids=[10**7]), "sampling": greedy()}, "token_ids"),
        ({"sampling": greedy()}, "prompt"),
        ({"text": "hi", "sampling": greedy(10**6)}, "max_tokens"),
    ]
    for request, field in cases:
        with pytest.raises(grpc.RpcError) as info:
            generate(mesh.router, **request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (info.value.details() or "")
    with pytest.raises(grpc.RpcError) as info:
        generate(mesh.router, model="nope", text="hi")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def _shared_prefix_requests(
    stub: router_pb2_grpc.RouterStub, mesh: Mesh, seed: int
) -> tuple[Outcome, Outcome, int]:
    """Two requests sharing a ~200-token prefix that no instance has seen; the second is
    sent once the index shows the first one's blocks."""
    tokenize = stub.Tokenize(router_pb2.TokenizeRequest(
        text=f"Story {seed}: " + " ".join(f"word{seed * 1000 + i}" for i in range(60))),
        timeout=30)
    prefix = list(tokenize.token_ids)[:200]
    assert len(prefix) == 200
    first = generate(stub, token_ids=router_pb2.TokenIds(ids=[*prefix, 11, 12, 13]),
                     sampling=greedy(2))
    scheme = HashScheme(block_size=16)
    hashes = hash_token_blocks(scheme, prefix)



    async def holders() -> dict[str, int]:
        conn = RedisConnection.from_url(mesh.local.redis_url)
        try:
            return await PrefixIndex(conn, KeySpace("smollm2")).longest_prefix(hashes)
        finally:
            await conn.aclose()

    assert first.result is not None
    holder = first.result.served_by.prefill_instance_id
    wait_for(lambda: asyncio.run(holders()).get(holder) == len(hashes), "prefix indexed")
    second = generate(stub, token_ids=router_pb2.TokenIds(ids=[*prefix, 21, 22, 23]),
                      sampling=greedy(2))
    return first, second, len(hashes) * 16


def test_shared_prefix_goes_to_its_holder_and_reports_cached_tokens(mesh: Mesh) -> None:
    first, second, cached = _shared_prefix_requests(mesh.router, mesh, seed=1)
    assert first.result is not None and second.result is not None
    assert first.result.usage.cached_prompt_tokens == 0
    assert (second.result.served_by.prefill_instance_id
            == first.result.served_by.prefill_instance_id), mesh.status()
    assert second.result.usage.cached_prompt_tokens == cached


def test_round_robin_misses_the_shared_prefix(mesh: Mesh) -> None:
    first, second, _ = _shared_prefix_requests(mesh.rr_router, mesh, seed=2)
    assert first.result is not None and second.result is not None
    assert (second.result.served_by.prefill_instance_id
            != first.result.served_by.prefill_instance_id)
    assert second.result.usage.cached_prompt_tokens == 0


def test_mismatched_hash_scheme_is_refused_at_registration(mesh: Mesh) -> None:
    argv = pdmesh_command(
        "prefill", "--redis-url", mesh.local.redis_url, "--kv-cache-memory", "32MiB",
        "--hash-root-seed", "not-the-cluster-seed",
    )
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode != 0
    assert "ready" not in proc.stdout
    assert "scheme" in proc.stderr and "root" in proc.stderr, proc.stderr[-2000:]
    assert len(mesh.status().instances) == 4


def _all_blocks_free(mesh: Mesh) -> bool:
    for role, children in (("prefill", mesh.local.prefill), ("decode", mesh.local.decode)):
        for child in children:
            if not child.running():
                continue
            load = engine_load(child.address or "", role)
            if (load.num_free_blocks != load.num_total_blocks or load.num_pinned_blocks
                    or load.num_running or load.num_waiting):
                return False
    return True


def test_client_cancel_mid_stream_frees_every_block(mesh: Mesh) -> None:
    wait_for(lambda: _all_blocks_free(mesh), "an idle mesh")
    call = mesh.router.Generate(
        router_pb2.GenerateRequest(
            text=PROMPTS[1] * 20, sampling=greedy(400, ignore_eos=True), stream=True
        ),
        timeout=120,
    )
    deltas = 0
    for resp in call:
        deltas += resp.HasField("delta")
        if deltas >= 3:
            break
    busy = [i for i in mesh.status().instances if i.num_inflight]
    assert busy, "the request should be in flight"
    call.cancel()
    wait_for(lambda: _all_blocks_free(mesh), "every block back after cancel", timeout_s=30)
    wait_for(lambda: not any(i.num_inflight for i in mesh.status().instances), "router idle")


def _health(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_requests_still_served_when_redis_stops(mesh: Mesh) -> None:
    assert mesh.status().prefix_index_available
    assert mesh.local.redis is not None
    mesh.local.redis.kill()
    out = generate(mesh.router, text=PROMPTS[2], sampling=greedy(4))
    assert len(out.token_ids) == 4 and out.result is not None
    status = wait_for(
        lambda: next((s for s in [mesh.status()] if not s.prefix_index_available), None),
        "the router noticing redis is gone",
    )
    assert "redis" in status.prefix_index_detail
    serving = health_pb2.HealthCheckResponse.SERVING
    assert _health(mesh.channel, "") == serving
    assert _health(mesh.channel, "pdmesh.v1.Router") == serving
    wait_for(lambda: _health(mesh.channel, "pdmesh.router.PrefixIndex") != serving,
             "index health NOT_SERVING")
    out = generate(mesh.router, text=PROMPTS[0], sampling=greedy(4))
    assert len(out.token_ids) == 4


def test_killed_decode_stream_migrates_and_the_instance_is_avoided(mesh: Mesh) -> None:
    call = mesh.router.Generate(
        router_pb2.GenerateRequest(
            text=PROMPTS[0] * 10, sampling=greedy(300, ignore_eos=True), stream=True
        ),
        timeout=120,
    )
    stream = iter(call)
    out = Outcome([], "", None, None)
    while len(out.token_ids) < 3:
        delta = next(stream).delta
        out.token_ids += delta.token_ids
    busy = [i for i in mesh.status().instances
            if i.num_inflight and i.role == engine_pb2.ROLE_DECODE]
    assert len(busy) == 1
    victim = next(c for c in mesh.local.decode if c.address == busy[0].address)
    victim.kill()
    rest = collect(stream)
    # Decode migration: the stream goes on on the other decode instance, no error event.
    assert rest.finish is not None
    assert rest.finish.reason == common_pb2.FINISH_REASON_LENGTH, rest.finish.message
    assert rest.result is not None
    assert len(out.token_ids) + len(rest.token_ids) == 300
    assert rest.result.usage.completion_tokens == 300
    dead_id = busy[0].instance_id
    dead = next(i for i in mesh.status().instances if i.instance_id == dead_id)
    assert not dead.healthy and dead.detail
    for prompt in PROMPTS[:2]:
        later = generate(mesh.router, text=prompt, sampling=greedy(3))
        assert later.result is not None
        assert later.result.served_by.decode_instance_id != dead_id
