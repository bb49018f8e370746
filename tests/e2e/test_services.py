"""Prefill and decode services as real processes on 127.0.0.1, a real redis-server, mTLS.

One prefill and one decode process serve the whole module over mutual TLS (certificates made
here), so every call also exercises TLS on the gRPC hop and on the KV transfer control
channel. The router is not involved: the test calls Prefill, then Decode, by hand.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.engine.block_hash import HashScheme, hash_token_blocks
from pdmesh.grpc_common import TLSConfig, open_channel
from pdmesh.kvstore.instance_registry import InstanceRegistry
from pdmesh.kvstore.prefix_index import PrefixIndex
from pdmesh.kvstore.redis_conn import RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace
from pdmesh.kvstore.redis_server import RedisServer, free_port
from pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.anyio, pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

MODEL = "smollm2"
LEASE_S = 3.0
SERVER_ARGS = ["--model", MODEL, "--kv-cache-memory", "48MiB", "--max-model-len", "512",
               "--heartbeat-ttl-s", "5"]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]
STARTUP_TIMEOUT_S = 90.0


# -- certificates ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # signed by a CA the servers do not trust
    rogue_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(
    subject: str, issuer_key: ec.EllipticCurvePrivateKey | None, issuer: x509.Name | None,
    *, ca: bool, server: bool = False,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer or _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return cert, key


def _write(directory: Path, name: str, cert: x509.Certificate,
           key: ec.EllipticCurvePrivateKey) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ))
    return cert_path, key_path


def make_certs(directory: Path) -> Certs:
    ca_cert, ca_key = _issue("pdmesh test CA", None, None, ca=True)
    ca_path, _ = _write(directory, "ca", ca_cert, ca_key)
    server_cert, server_key = _issue("pdmesh server", ca_key, ca_cert.subject, ca=False,
                                     server=True)
    client_cert, client_key = _issue("pdmesh client", ca_key, ca_cert.subject, ca=False)
    rogue_ca, rogue_ca_key = _issue("rogue CA", None, None, ca=True)
    rogue_cert, rogue_key = _issue("rogue client", rogue_ca_key, rogue_ca.subject, ca=False)
    return Certs(
        ca_path,
        *_write(directory, "server", server_cert, server_key),
        *_write(directory, "client", client_cert, client_key),
        *_write(directory, "rogue", rogue_cert, rogue_key),
    )


# -- processes ------------------------------------------------------------------------------------
@dataclass
class Service:
    proc: subprocess.Popen[str]
    address: str
    instance_id: str
    log: Path


def start_service(kind: str, args: list[str], log: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PDMESH_LOG_LEVEL="info", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "pdmesh.cli", kind, *args],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env,
    )


def wait_ready(proc: subprocess.Popen[str], log: Path, timeout_s: float) -> tuple[str, str]:
    """Block on the process's stdout until its `ready` line (or exit, or the deadline)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                continue
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("ready "):
                fields = dict(f.split("=", 1) for f in line.split()[2:] if "=" in f)
                return line.split()[1], fields["instance_id"]
    raise AssertionError(
        f"service not ready (exit code {proc.poll()}); log:\n{log.read_text()[-3000:]}"
    )


def stop_service(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            return -9
    return proc.returncode


@dataclass
class Mesh:
    prefill: Service
    decode: Service
    certs: Certs
    redis: RedisServer

    @property
    def client_tls(self) -> TLSConfig:
        return TLSConfig(str(self.certs.client_cert), str(self.certs.client_key),
                         str(self.certs.ca))


@pytest.fixture(name="mesh", scope="module")
def mesh_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    directory = tmp_path_factory.mktemp("mesh")
    certs = make_certs(directory)
    tls = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
           "--tls-ca", str(certs.ca)]
    with RedisServer() as redis:
        common = [*SERVER_ARGS, *tls, "--redis-url", redis.url]
        logs = {kind: directory / f"{kind}.log" for kind in ("prefill", "decode")}
        procs = {
            "prefill": start_service("prefill", [*common, "--lease-s", str(LEASE_S)],
                                     logs["prefill"]),
            "decode": start_service("decode", common, logs["decode"]),
        }
        try:
            services = {}
            for kind, proc in procs.items():
                address, instance_id = wait_ready(proc, logs[kind], STARTUP_TIMEOUT_S)
                services[kind] = Service(proc, address, instance_id, logs[kind])
            yield Mesh(services["prefill"], services["decode"], certs, redis)
        finally:
            codes = {kind: stop_service(proc) for kind, proc in procs.items()}
        assert codes == {"prefill": 0, "decode": 0}, codes


@pytest.fixture(name="reference", scope="module")
def reference_fixture() -> dict[str, tuple[list[int], list[int], str]]:
    """prompt -> (prompt ids, greedy output ids, text) from the offline `pdmesh.LLM`."""
    from pdmesh import LLM, SamplingParams

    llm = LLM(MODEL, kv_cache_memory="48MiB", max_model_len=512)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    return {p: (list(o.prompt_token_ids), list(o.outputs[0].token_ids), o.outputs[0].text)
            for p, o in zip(PROMPTS, outs, strict=True)}


@pytest.fixture(name="anyio_backend", scope="module")
def anyio_backend_fixture() -> str:
    return "asyncio"


@dataclass
class Stubs:
    prefill: engine_pb2_grpc.PrefillStub
    decode: engine_pb2_grpc.DecodeStub


@pytest.fixture(name="stubs")
async def stubs_fixture(mesh: Mesh) -> AsyncIterator[Stubs]:
    p_channel = open_channel(mesh.prefill.address, mesh.client_tls)
    d_channel = open_channel(mesh.decode.address, mesh.client_tls)
    yield Stubs(engine_pb2_grpc.PrefillStub(p_channel), engine_pb2_grpc.DecodeStub(d_channel))
    await p_channel.close()
    await d_channel.close()


async def wait_until(predicate: Callable[[], Awaitable[bool]], what: str,
                     timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout_s}s: {what}")


async def all_free(stubs: Stubs) -> bool:
    loads = [await stubs.prefill.GetLoad(engine_pb2.GetLoadRequest()),
             await stubs.decode.GetLoad(engine_pb2.GetLoadRequest())]
    return all(
        load.num_free_blocks == load.num_total_blocks and load.num_pinned_blocks == 0
        and load.num_running == 0 and load.num_waiting == 0
        for load in loads
    )


def greedy(max_tokens: int, **extra: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)


async def prefill_then_decode(
    stubs: Stubs, request_id: str, prompt_ids: list[int], sampling: common_pb2.SamplingParams
) -> tuple[engine_pb2.PrefillResponse, list[common_pb2.SequenceDelta], engine_pb2.DecodeResult]:
    pre = await stubs.prefill.Prefill(engine_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling,
    ))
    deltas: list[common_pb2.SequenceDelta] = []
    result = None
    call = stubs.decode.Decode(engine_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling,
        remote_prefill=engine_pb2.RemotePrefill(
            kv=pre.kv, first=pre.first, cached_prompt_tokens=pre.cached_prompt_tokens
        ),
    ))
    async for msg in call:
        if msg.HasField("delta"):
            assert result is None, "no delta after the result"
            deltas.append(msg.delta)
        else:
            result = msg.result
    assert result is not None
    return pre, deltas, result


# -- tests -----------------------------------------------------------------------------------------
async def test_info_health_and_registration(mesh: Mesh, stubs: Stubs) -> None:
    p_info = await stubs.prefill.GetInfo(engine_pb2.GetInfoRequest())
    d_info = await stubs.decode.GetInfo(engine_pb2.GetInfoRequest())
    assert p_info.role == engine_pb2.ROLE_PREFILL and d_info.role == engine_pb2.ROLE_DECODE
    assert p_info.instance_id == mesh.prefill.instance_id != d_info.instance_id
    assert p_info.hash_scheme_fingerprint == d_info.hash_scheme_fingerprint
    assert p_info.max_model_len == 512 and p_info.block_size == 16
    # The start-up self-check is for accelerators: on a CPU it says so and turns nothing off.
    for info in (p_info, d_info):
        assert info.selfcheck.startswith("not run") and not info.selfcheck_fallbacks
    assert "tcp" in p_info.kv_backends and p_info.kv_capacity_tokens > 0

    channel = open_channel(mesh.prefill.address, mesh.client_tls)
    health = health_pb2_grpc.HealthStub(channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(service="pdmesh.v1.Prefill"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    await channel.close()

    conn = RedisConnection.from_url(mesh.redis.url)
    try:
        registry = InstanceRegistry(conn, KeySpace(model=MODEL))
        live = {i.instance_id: i for i in await registry.live_instances()}
        assert live[p_info.instance_id].role == "prefill"
        assert live[d_info.instance_id].role == "decode"
        assert live[p_info.instance_id].address == mesh.prefill.address
        assert live[p_info.instance_id].scheme_fingerprint == p_info.hash_scheme_fingerprint
        assert live[p_info.instance_id].kv_address
    finally:
        await conn.aclose()


async def test_prefill_then_decode_equals_llm(
    mesh: Mesh, stubs: Stubs, reference: dict[str, tuple[list[int], list[int], str]]
) -> None:
    before = {
        "p": await stubs.prefill.GetLoad(engine_pb2.GetLoadRequest()),
        "d": await stubs.decode.GetLoad(engine_pb2.GetLoadRequest()),
    }
    moved = 0
    for i, prompt in enumerate(PROMPTS):
        prompt_ids, want_ids, want_text = reference[prompt]
        pre, deltas, result = await prefill_then_decode(
            stubs, f"pd-{i}", prompt_ids, greedy(24, logprobs=1)
        )
        assert pre.HasField("kv") and pre.instance_id == mesh.prefill.instance_id
        assert len(pre.first) == 1 and len(pre.first[0].token_ids) == 1
        layout = pre.kv.layout
        moved += (layout.num_layers * 2 * layout.num_blocks * layout.block_size
                  * layout.num_kv_heads * layout.head_dim * 4)
        got_ids = list(pre.first[0].token_ids) + [t for d in deltas for t in d.token_ids]
        got_text = pre.first[0].text + "".join(d.text for d in deltas)
        assert got_ids == want_ids, prompt
        assert got_text == want_text, prompt
        assert deltas[-1].HasField("finish") and sum(d.HasField("finish") for d in deltas) == 1
        assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
        assert result.usage.prompt_tokens == len(prompt_ids)
        assert result.usage.completion_tokens == len(want_ids)
        assert result.instance_id == mesh.decode.instance_id
    # KV bytes: what left prefill (acknowledged) arrived at decode, and equals the layouts.
    await wait_until(lambda: all_free(stubs), "all blocks free after the requests")
    after = {
        "p": await stubs.prefill.GetLoad(engine_pb2.GetLoadRequest()),
        "d": await stubs.decode.GetLoad(engine_pb2.GetLoadRequest()),
    }
    sent = after["p"].kv_bytes_sent - before["p"].kv_bytes_sent
    received = after["d"].kv_bytes_received - before["d"].kv_bytes_received
    assert sent == received == moved > 0
    assert after["p"].kv_transfers_sent - before["p"].kv_transfers_sent == len(PROMPTS)
    assert after["d"].kv_transfers_received - before["d"].kv_transfers_received == len(PROMPTS)


async def test_local_prefill_on_decode_equals_llm(
    stubs: Stubs, reference: dict[str, tuple[list[int], list[int], str]]
) -> None:
    prompt_ids, want_ids, want_text = reference[PROMPTS[0]]
    deltas, result = [], None
    async for msg in stubs.decode.Decode(engine_pb2.DecodeRequest(
        request_id="local-0", prompt_token_ids=prompt_ids,
        sampling=greedy(24, prompt_logprobs=0),
    )):
        if msg.HasField("delta"):
            deltas.append(msg.delta)
        else:
            result = msg.result
    assert [t for d in deltas for t in d.token_ids] == want_ids
    assert "".join(d.text for d in deltas) == want_text
    assert result is not None and len(result.prompt_logprobs) == len(prompt_ids) - 1


async def test_prefix_index_knows_prefill_blocks(
    mesh: Mesh, stubs: Stubs, reference: dict[str, tuple[list[int], list[int], str]]
) -> None:
    long_ids = reference[PROMPTS[2]][0] * 6  # several full blocks
    pre = await stubs.prefill.Prefill(engine_pb2.PrefillRequest(
        request_id="idx-0", prompt_token_ids=long_ids, sampling=greedy(4),
    ))
    await stubs.prefill.ReleaseKV(engine_pb2.ReleaseKVRequest(
        request_id="idx-0", transfer_id=pre.kv.transfer_id, reason="test"))
    scheme = HashScheme(block_size=16)
    hashes = hash_token_blocks(scheme, long_ids, None)
    conn = RedisConnection.from_url(mesh.redis.url)
    try:
        index = PrefixIndex(conn, KeySpace(model=MODEL))

        async def indexed() -> bool:
            return (await index.longest_prefix(hashes)).get(mesh.prefill.instance_id, 0) == len(
                hashes)

        await wait_until(indexed, "prefill blocks in the Redis prefix index", timeout_s=10)
    finally:
        await conn.aclose()
    # A second prefill of the same prompt is served from the prefix cache.
    again = await stubs.prefill.Prefill(engine_pb2.PrefillRequest(
        request_id="idx-1", prompt_token_ids=long_ids, sampling=greedy(1),
    ))
    assert not again.HasField("kv")  # max_tokens=1: done at the first token, nothing held
    assert again.first[0].finish.reason == common_pb2.FINISH_REASON_LENGTH
    assert again.cached_prompt_tokens >= 16 * (len(long_ids) // 16 - 1)
    await wait_until(lambda: all_free(stubs), "all blocks free")


async def test_cancel_decode_stream_frees_both_sides(
    stubs: Stubs, reference: dict[str, tuple[list[int], list[int], str]]
) -> None:
    prompt_ids = reference[PROMPTS[1]][0]
    sampling = greedy(400, ignore_eos=True)
    pre = await stubs.prefill.Prefill(engine_pb2.PrefillRequest(
        request_id="cancel-0", prompt_token_ids=prompt_ids, sampling=sampling))
    call = stubs.decode.Decode(engine_pb2.DecodeRequest(
        request_id="cancel-0", prompt_token_ids=prompt_ids, sampling=sampling,
        remote_prefill=engine_pb2.RemotePrefill(kv=pre.kv, first=pre.first),
    ))
    seen = 0
    async for msg in call:
        assert msg.HasField("delta") and not msg.delta.HasField("finish")
        seen += 1
        if seen == 3:
            break
    decode_load = await stubs.decode.GetLoad(engine_pb2.GetLoadRequest())
    assert decode_load.num_running == 1
    call.cancel()
    await wait_until(lambda: all_free(stubs), "blocks freed on both sides after cancel")


async def test_lease_expiry_without_decode_frees_prefill(
    stubs: Stubs, reference: dict[str, tuple[list[int], list[int], str]]
) -> None:
    prompt_ids = reference[PROMPTS[2]][0] * 3
    pre = await stubs.prefill.Prefill(engine_pb2.PrefillRequest(
        request_id="lease-0", prompt_token_ids=prompt_ids, sampling=greedy(8)))
    assert pre.HasField("kv")
    load = await stubs.prefill.GetLoad(engine_pb2.GetLoadRequest())
    assert load.num_pinned_blocks == pre.kv.layout.num_blocks
    started = time.monotonic()
    await wait_until(lambda: all_free(stubs), "lease expiry frees the pinned blocks",
                     timeout_s=LEASE_S + 10)
    assert time.monotonic() - started > LEASE_S / 2  # freed by the lease, not at once
    # A decode arriving after the lease ended never reads stale KV: its pull fails and, under
    # the default `recompute` policy, it prefills the prompt itself, keeping the first token.
    async def decode(request_id: str, remote: engine_pb2.RemotePrefill | None
                     ) -> tuple[list[int], engine_pb2.DecodeResult]:
        ids, result = [], engine_pb2.DecodeResult()
        async for resp in stubs.decode.Decode(engine_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=prompt_ids, sampling=greedy(8),
            remote_prefill=remote,
        )):
            if resp.HasField("delta"):
                ids += resp.delta.token_ids
            else:
                result = resp.result
        return ids, result

    after_lease, result = await decode(
        "lease-0", engine_pb2.RemotePrefill(kv=pre.kv, first=pre.first))
    assert result.kv_load_fallback, "the failed pull is reported"
    local, _ = await decode("lease-local", None)
    assert list(pre.first[0].token_ids) + after_lease == local
    await wait_until(lambda: all_free(stubs), "nothing held after the failed pull")


async def test_abort_and_release_are_idempotent(
    stubs: Stubs, reference: dict[str, tuple[list[int], list[int], str]]
) -> None:
    prompt_ids = reference[PROMPTS[0]][0]
    pre = await stubs.prefill.Prefill(engine_pb2.PrefillRequest(
        request_id="rel-0", prompt_token_ids=prompt_ids, sampling=greedy(8)))
    release = engine_pb2.ReleaseKVRequest(request_id="rel-0", transfer_id=pre.kv.transfer_id)
    assert (await stubs.prefill.ReleaseKV(release)).released
    assert not (await stubs.prefill.ReleaseKV(release)).released
    assert not (await stubs.prefill.Abort(engine_pb2.AbortRequest(request_id="rel-0"))).found
    await wait_until(lambda: all_free(stubs), "released")


async def test_a_first_token_no_mask_allows_ends_the_request_at_the_prefill(
    stubs: Stubs, reference: dict[str, tuple[list[int], list[int], str]]
) -> None:
    """allowed_token_ids that min_tokens bans leave no first token: the prefill answers
    finished ("stop", no token), holds nothing and lends nothing, on both of its calls."""
    boxed = greedy(8, allowed_token_ids=[5], stop_token_ids=[5], min_tokens=1)
    prompt_ids = reference[PROMPTS[0]][0]
    pre = await stubs.prefill.Prefill(engine_pb2.PrefillRequest(
        request_id="dead-0", prompt_token_ids=prompt_ids, sampling=boxed))
    streamed = [m async for m in stubs.prefill.PrefillStream(engine_pb2.PrefillRequest(
        request_id="dead-1", prompt_token_ids=prompt_ids, sampling=boxed))]
    for response in (pre, streamed[-1].done):
        assert not response.HasField("kv")
        assert [(list(d.token_ids), d.finish.reason) for d in response.first] == [
            ([], common_pb2.FINISH_REASON_STOP)]
    await wait_until(lambda: all_free(stubs), "nothing held after a dead end")


async def test_invalid_requests_are_refused(stubs: Stubs) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stubs.prefill.Prefill(engine_pb2.PrefillRequest(
            request_id="bad-0", prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(
                temperature=-1.0)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stubs.prefill.Prefill(engine_pb2.PrefillRequest(
            request_id="bad-1", prompt_token_ids=[], sampling=greedy(4)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_mtls_refuses_clients_without_a_trusted_certificate(mesh: Mesh) -> None:
    certs = mesh.certs
    refused = [
        TLSConfig(ca=str(certs.ca)),  # TLS, but no client certificate
        TLSConfig(str(certs.rogue_cert), str(certs.rogue_key), str(certs.ca)),
    ]
    for tls in refused:
        channel = open_channel(mesh.decode.address, tls)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await engine_pb2_grpc.DecodeStub(channel).GetInfo(
                engine_pb2.GetInfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await channel.close()
    plaintext = grpc.aio.insecure_channel(mesh.prefill.address)
    with pytest.raises(grpc.aio.AioRpcError):
        await engine_pb2_grpc.PrefillStub(plaintext).GetInfo(
            engine_pb2.GetInfoRequest(), timeout=5)
    await plaintext.close()
    trusted = open_channel(mesh.decode.address, mesh.client_tls)
    info = await engine_pb2_grpc.DecodeStub(trusted).GetInfo(engine_pb2.GetInfoRequest())
    assert info.instance_id == mesh.decode.instance_id
    await trusted.close()


async def test_colocated_instance_serves_both_without_redis(
    tmp_path: Path, reference: dict[str, tuple[list[int], list[int], str]]
) -> None:
    """`--role colocated` serves Prefill and Decode from one engine; a Redis that cannot be
    reached is logged and retried, never fatal (health stays SERVING)."""
    log = tmp_path / "colocated.log"
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    proc = start_service("decode", [*SERVER_ARGS, "--role", "colocated",
                                    "--redis-url", unreachable], log)
    try:
        address, instance_id = wait_ready(proc, log, STARTUP_TIMEOUT_S)
        channel = open_channel(address)
        stubs = Stubs(engine_pb2_grpc.PrefillStub(channel), engine_pb2_grpc.DecodeStub(channel))
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        info = await stubs.decode.GetInfo(engine_pb2.GetInfoRequest())
        assert info.role == engine_pb2.ROLE_COLOCATED and info.instance_id == instance_id
        prompt_ids, want_ids, _ = reference[PROMPTS[1]]
        pre, deltas, result = await prefill_then_decode(stubs, "co-0", prompt_ids, greedy(24))
        assert list(pre.first[0].token_ids) + [t for d in deltas for t in d.token_ids] == want_ids
        assert result.instance_id == pre.instance_id == instance_id
        load = await stubs.decode.GetLoad(engine_pb2.GetLoadRequest())
        assert load.kv_bytes_sent == load.kv_bytes_received > 0
        await wait_until(lambda: all_free(stubs), "colocated blocks freed")
        await channel.close()
    finally:
        assert stop_service(proc) == 0
    assert "redis" in log.read_text().lower()  # the outage was reported
