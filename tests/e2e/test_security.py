"""Secure by default (issue 13), on real processes over 127.0.0.1.

A mutual-TLS mesh with a cluster token (1 prefill, 1 decode, router, HTTPS gateway, the
embedded redis-server; certificates made here) must refuse plaintext on every port it listens
on, refuse a KV transfer to anybody but the decode instance the router chose, and never route
to (or even dial) a registry entry not signed with the token. A single engine started with a
token but no CA shows the token-only mode: internal calls without the token are
UNAUTHENTICATED, health probes are not.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import socket
import ssl
import struct
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import msgspec
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.auth import METADATA_KEY, ClusterToken
from pdmesh.kvstore.connector.tcp_blocks import PullRequest
from pdmesh.kvstore.instance_registry import InstanceInfo, InstanceRegistry
from pdmesh.kvstore.redis_conn import RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace
from pdmesh.kvstore.transfer.capability import TransferCapability
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import KVTransferDenied
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.receiver import KVReceiver, KVReceiverConfig
from pdmesh.kvstore.transfer.wire import MAGIC
from pdmesh.serve import Child, LocalMesh, MeshConfig, pdmesh_command
from pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from tests.certs import CertSet, make_test_certs
from tests.polling import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

TOKEN = ClusterToken("e2e-cluster-token-" + "z" * 26)
AUTH = ((METADATA_KEY, TOKEN.value),)
KV_MEMORY = "48MiB"
PROMPT = "The three primary colors are red, yellow and"




def greedy(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens)


# -- the TLS mesh ---------------------------------------------------------------------------------
@dataclass
class Mesh:
    local: LocalMesh
    certs: CertSet
    creds: grpc.ChannelCredentials  # a trusted client certificate

    def channel(self, address: str) -> grpc.Channel:
        return grpc.secure_channel(address, self.creds)


@pytest.fixture(name="mesh", scope="module")
def mesh_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    certs = make_test_certs(tmp_path_factory.mktemp("certs"))
    config = MeshConfig(
        num_prefill=1, num_decode=1, kv_cache_memory=KV_MEMORY, local_prefill_threshold=0,
        port=0, kv_backend="tcp", tls_cert=str(certs.cert), tls_key=str(certs.key),
        tls_ca=str(certs.ca),
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_CLUSTER_TOKEN")}
    env["PDMESH_CLUSTER_TOKEN"] = TOKEN.value
    creds = grpc.ssl_channel_credentials(certs.ca.read_bytes(), certs.key.read_bytes(),
                                         certs.cert.read_bytes())
    with LocalMesh(config, router_args=["--poll-interval-s", "0.2"], env=env) as local:
        mesh = Mesh(local, certs, creds)
        with mesh.channel(local.router_address) as channel:
            router = router_pb2_grpc.RouterStub(channel)
            wait_for(lambda: [i.healthy for i in router.GetStatus(
                router_pb2.GetStatusRequest(), timeout=5).instances] == [True, True],
                "both engines routable")
        yield mesh


def generate(mesh: Mesh, prompt: str = PROMPT) -> router_pb2.GenerateResult:
    with mesh.channel(mesh.local.router_address) as channel:
        stream = router_pb2_grpc.RouterStub(channel).Generate(
            router_pb2.GenerateRequest(text=prompt, sampling=greedy(4)), timeout=120)
        results = [r.result for r in stream if r.HasField("result")]
    assert len(results) == 1
    return results[0]


def kv_address(mesh: Mesh) -> str:
    async def read() -> str:
        conn = RedisConnection.from_url(mesh.local.redis_url)
        try:
            live = await InstanceRegistry(conn, KeySpace(model="smollm2")).live_instances()
        finally:
            await conn.aclose()
        return next(i.kv_address for i in live if i.role == "prefill" and i.kv_address)

    return asyncio.run(read())


def held_handle(mesh: Mesh, request_id: str) -> KVHandle:
    """Prefill a prompt on the prefill instance directly (as the router does): its KV is held
    for one pull."""
    (prefill,) = mesh.local.prefill
    with mesh.channel(prefill.address or "") as channel:
        response = engine_pb2_grpc.PrefillStub(channel).Prefill(
            engine_pb2.PrefillRequest(request_id=request_id, sampling=greedy(4),
                                      prompt_token_ids=list(range(100, 140))),
            timeout=60, metadata=AUTH)
    assert response.HasField("kv")
    return KVHandle.from_proto(response.kv)


def release(mesh: Mesh, handle: KVHandle) -> None:
    (prefill,) = mesh.local.prefill
    with mesh.channel(prefill.address or "") as channel:
        engine_pb2_grpc.PrefillStub(channel).ReleaseKV(engine_pb2.ReleaseKVRequest(
            request_id=handle.request_id, transfer_id=handle.transfer_id, reason="test"),
            timeout=10, metadata=AUTH)


def test_routed_requests_pull_kv_with_a_capability(mesh: Mesh) -> None:
    result = generate(mesh)
    served = result.served_by
    assert served.prefill_instance_id and served.prefill_instance_id != served.decode_instance_id
    assert result.usage.completion_tokens == 4


def test_plaintext_is_refused_on_every_port(mesh: Mesh) -> None:
    local = mesh.local
    grpc_ports = {
        "router": local.router_address,
        "prefill": local.prefill[0].address or "",
        "decode": local.decode[0].address or "",
        "kv control": kv_address(mesh),
    }
    for name, address in grpc_ports.items():
        with grpc.insecure_channel(address) as channel, \
                pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, name
        assert _answers_over_mtls(mesh, address), name

    # KV data: start a real transfer, then knock on its tcp port in plaintext with the
    # right one-time token. Not one byte of KV may come back.
    handle = held_handle(mesh, "plaintext-data-port")
    data = asyncio.run(_plaintext_on_data_port(mesh, handle))
    assert MAGIC not in data and b"PDBR" not in data and len(data) < 512

    # HTTP: the gateway speaks HTTPS only; /metrics ports too.
    gateway = local.gateway
    assert gateway is not None and gateway.address and local.gateway_url
    assert local.gateway_url.startswith("https://")
    host, port = gateway.address.rsplit(":", 1)
    plain = http.client.HTTPConnection(host, int(port), timeout=10)
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        plain.request("GET", "/v1/models")
        plain.getresponse()
    plain.close()
    ctx = ssl.create_default_context(cafile=str(mesh.certs.ca))
    with urllib.request.urlopen(f"{local.gateway_url}/models", context=ctx, timeout=30) as r:
        assert r.status == 200
    for child in local.children:
        url = child.metrics_url
        if url:
            assert url.startswith("https://"), (child.name, url)
            with pytest.raises(OSError):
                urllib.request.urlopen(url.replace("https://", "http://"), timeout=10).read()
            with urllib.request.urlopen(url, context=ctx, timeout=10) as r:
                assert r.status == 200


def _answers_over_mtls(mesh: Mesh, address: str) -> bool:
    """The same port does answer a client with a trusted certificate (the KV control port
    has no health service: UNIMPLEMENTED is an answer too)."""
    with mesh.channel(address) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.UNIMPLEMENTED
    return True


async def _plaintext_on_data_port(mesh: Mesh, handle: KVHandle) -> bytes:
    receiver = KVReceiver(KVReceiverConfig(backends=("tcp",)), tls=mesh.certs.tls, token=TOKEN)
    try:
        control = receiver.control(handle.sender_address)
        granted = TransferCapability.mint(TOKEN, handle.transfer_id, "the-test")
        reply = await control.start(handle, "tcp", "", 20, Deadline.after(10),
                                    capability=granted)
        params = reply.params  # the prefill core's block server, and a signed one-time grant
        assert params.get("tls") == "1"
        lay = handle.layout
        body = msgspec.msgpack.encode(PullRequest(
            params["request"], params["transfer"], params["grant"], params["mac"], 0,
            lay.num_blocks, (lay.num_layers, lay.block_size, lay.num_kv_heads, lay.head_dim),
            lay.dtype_name))
        request = struct.pack("<4sBI", b"PDBQ", 1, len(body)) + body
        host, port = params["address"].rsplit(":", 1)

        def knock() -> bytes:
            data = b""
            with socket.create_connection((host, int(port)), 5) as sock:
                sock.sendall(request)
                try:
                    while chunk := sock.recv(65536):
                        data += chunk
                except OSError:
                    pass
            return data

        data = await asyncio.to_thread(knock)
        await control.cancel(handle, "test over", Deadline.after(5))
        return data
    finally:
        await receiver.close()


def test_a_stolen_transfer_is_refused(mesh: Mesh) -> None:
    handle = held_handle(mesh, "stolen-transfer")

    async def steal() -> None:
        # A cluster member (trusted certificate, the token) that the router did not choose.
        async with KVReceiver(KVReceiverConfig(backends=("tcp",)), tls=mesh.certs.tls,
                              token=TOKEN) as thief:
            with pytest.raises(KVTransferDenied, match="no transfer capability"):
                await thief.fetch(handle, 10)
            forged = TransferCapability("decode-x", int(time.time() * 1000) + 60_000, "00" * 32)
            with pytest.raises(KVTransferDenied, match="does not match"):
                await thief.fetch(handle, 10, capability=forged)
            other = TransferCapability.mint(TOKEN, "f" * 32, "decode-x")  # another transfer's
            with pytest.raises(KVTransferDenied, match="does not match"):
                await thief.fetch(handle, 10, capability=other)
        # Without the token the control channel does not even answer.
        async with KVReceiver(KVReceiverConfig(backends=("tcp",)), tls=mesh.certs.tls) as rogue:
            with pytest.raises(KVTransferDenied, match="UNAUTHENTICATED"):
                await rogue.fetch(handle, 10)

    asyncio.run(steal())
    release(mesh, handle)  # still PENDING: the refusals took nothing


class _Listener:
    """A TCP port that counts who connects: the address a forged registry entry names."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


def test_forged_registry_entries_are_never_routed_to(mesh: Mesh) -> None:
    traps = [_Listener(), _Listener()]  # one address each: a registration evicts others there

    async def forge() -> list[str]:
        conn = RedisConnection.from_url(mesh.local.redis_url)
        registry = InstanceRegistry(conn, KeySpace(model="smollm2"), ttl_s=60)
        try:
            live = await registry.live_instances()
            genuine = next(i for i in live if i.role == "decode")
            unsigned = replace(genuine, instance_id="decode-forged-unsigned",
                               address=traps[0].address, signature="")
            # A genuine entry's signature does not carry over to another address.
            forged = replace(genuine, instance_id="decode-forged-copied",
                             address=traps[1].address)
            for entry in (unsigned, forged):
                await registry.register(InstanceInfo.from_fields(entry.instance_id,
                                                                 entry.to_fields()))
            return [i.instance_id for i in await registry.live_instances()]
        finally:
            await conn.aclose()

    try:
        ids = asyncio.run(forge())
        assert {"decode-forged-unsigned", "decode-forged-copied"} <= set(ids)
        genuine_id = mesh.local.decode[0].fields["instance_id"]
        for i in range(3):  # several poll rounds (0.2 s) and requests
            result = generate(mesh, f"{PROMPT} blue {i}")
            assert result.served_by.decode_instance_id == genuine_id
            time.sleep(0.3)
        with mesh.channel(mesh.local.router_address) as channel:
            status = router_pb2_grpc.RouterStub(channel).GetStatus(
                router_pb2.GetStatusRequest(), timeout=5)
        for trap in traps:
            assert trap.address not in [i.address for i in status.instances]
            assert trap.connections == 0, "the router dialled a forged address"
        ctx = ssl.create_default_context(cafile=str(mesh.certs.ca))
        router_child = mesh.local.router
        assert router_child is not None and router_child.metrics_url
        with urllib.request.urlopen(router_child.metrics_url, context=ctx, timeout=10) as r:
            text = r.read().decode()
        assert 'pdmesh:registry_rejected_entries_total{reason="unsigned"} 1.0' in text
        assert 'pdmesh:registry_rejected_entries_total{reason="forged"} 1.0' in text
    finally:
        for trap in traps:
            trap.close()


# -- token only (no CA) --------------------------------------------------------------------------
def test_token_only_mode_refuses_calls_without_the_token(tmp_path: Path) -> None:
    token_file = tmp_path / "cluster-token"
    token_file.write_text(TOKEN.value + "\n")
    token_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_CLUSTER_TOKEN")}
    decode = Child("decode", pdmesh_command(
        "decode", "--kv-cache-memory", KV_MEMORY, "--metrics-port", "-1",
        "--cluster-token-file", str(token_file)), env=env)
    try:
        address = decode.wait_ready(timeout_s=180)
        with grpc.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.DecodeStub(channel)
            for metadata in ((), ((METADATA_KEY, "not-the-token-" + "x" * 20),)):
                with pytest.raises(grpc.RpcError) as info:
                    stub.GetInfo(engine_pb2.GetInfoRequest(), timeout=10, metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.Decode(engine_pb2.DecodeRequest(
                        request_id="r", prompt_token_ids=[1, 2, 3], sampling=greedy(2)),
                        timeout=10, metadata=metadata))
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            probe = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
            assert probe.status == health_pb2.HealthCheckResponse.SERVING
            info_ok = stub.GetInfo(engine_pb2.GetInfoRequest(), timeout=10, metadata=AUTH)
            assert info_ok.model == "smollm2"
            outs = list(stub.Decode(engine_pb2.DecodeRequest(
                request_id="ok", prompt_token_ids=[1, 2, 3], sampling=greedy(2)),
                timeout=60, metadata=AUTH))
            assert outs[-1].HasField("result")
        # The token never appears on the command line.
        cmdline = subprocess.run(["ps", "-o", "args=", "-p", str(decode.pid)],
                                 capture_output=True, text=True, timeout=10).stdout
        assert TOKEN.value not in cmdline
    finally:
        decode.terminate()
