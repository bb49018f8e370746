"""Cluster token, transfer capabilities and signed registrations: the HMAC pieces of issue 13,
plus the token interceptor on a real gRPC server on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdmesh.auth import (
    METADATA_KEY,
    ClusterToken,
    TokenError,
    client_interceptors,
    load_cluster_token,
    server_interceptors,
)
from pdmesh.engine.block_hash import HashScheme
from pdmesh.kvstore.instance_registry import (
    InstanceInfo,
    InstanceRegistry,
    registration_problem,
    sign_registration,
)
from pdmesh.kvstore.redis_conn import (
    IndexUnavailable,
    RedisConnection,
    RedisSettings,
    redacted_url,
)
from pdmesh.kvstore.redis_schema import KeySpace
from pdmesh.kvstore.redis_server import RedisServer
from pdmesh.kvstore.transfer.capability import MAX_CLOCK_SKEW_S, TransferCapability
from pdmesh.v1 import engine_pb2, engine_pb2_grpc
from tests.redis_fixture import (  # noqa: F401
    anyio_backend_fixture,
    conn_fixture,
    keyspace_fixture,
    redis_server_fixture,
)

TOKEN = ClusterToken("t" * 40)
OTHER = ClusterToken("u" * 40)
TID = "0123456789abcdef0123456789abcdef"


# -- the token ----------------------------------------------------------------------------
@pytest.mark.fast
def test_token_from_file_then_env_never_shown(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("s3cret-token-from-a-file\n")
    path.chmod(0o600)
    token = load_cluster_token(str(path), env={"PDMESH_CLUSTER_TOKEN": "x" * 20})
    assert token is not None and token.value == "s3cret-token-from-a-file"
    assert "s3cret" not in repr(token)
    via_env_file = load_cluster_token(env={"PDMESH_CLUSTER_TOKEN_FILE": str(path)})
    assert via_env_file == token
    assert load_cluster_token(env={"PDMESH_CLUSTER_TOKEN": "y" * 20}) == ClusterToken("y" * 20)
    assert load_cluster_token(env={}) is None
    with pytest.raises(TokenError, match="at least"):
        load_cluster_token(env={"PDMESH_CLUSTER_TOKEN": "short"})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(TokenError, match="empty"):
        load_cluster_token(str(tmp_path / "empty"), env={})


@pytest.mark.fast
def test_token_matches_and_signatures_are_bound_to_everything() -> None:
    assert TOKEN.matches("t" * 40) and TOKEN.matches(b"t" * 40)
    assert not TOKEN.matches("t" * 39) and not TOKEN.matches(None) and not TOKEN.matches("é")
    mac = TOKEN.sign("purpose", "ab", "c")
    assert TOKEN.verify(mac, "purpose", "ab", "c")
    assert not TOKEN.verify(mac, "purpose", "a", "bc")  # fields are length-prefixed
    assert not TOKEN.verify(mac, "other", "ab", "c")  # domain separation
    assert not OTHER.verify(mac, "purpose", "ab", "c")
    assert not TOKEN.verify("", "purpose", "ab", "c")


@pytest.mark.fast
def test_rotation_uses_the_first_token_and_accepts_all(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("new-token-aaaaaaaaaaaa\nold-token-bbbbbbbbbbbb\n")
    rotating = load_cluster_token(str(path), env={})
    assert rotating is not None and rotating.value == "new-token-aaaaaaaaaaaa"
    old = ClusterToken("old-token-bbbbbbbbbbbb")
    assert rotating.metadata() == (("pdmesh-cluster-token", "new-token-aaaaaaaaaaaa"),)
    assert rotating.matches(old.value) and rotating.matches("new-token-aaaaaaaaaaaa")
    assert rotating.verify(old.sign("p", "x"), "p", "x")  # signed before the rotation
    assert not old.verify(rotating.sign("p", "x"), "p", "x")  # old-only processes do not
    assert not rotating.matches("third-token-cccccccccc")


# -- transfer capabilities ------------------------------------------------------------------
@pytest.mark.fast
def test_capability_grants_one_transfer_to_one_receiver_until_it_expires() -> None:
    now = 1_000_000.0
    cap = TransferCapability.mint(TOKEN, TID, "decode-a", ttl_s=60, clock=lambda: now)
    assert cap.check(TOKEN, TID, clock=lambda: now) is None
    assert TransferCapability.from_proto(cap.to_proto()) == cap
    assert "does not match" in (cap.check(TOKEN, "f" * 32, clock=lambda: now) or "")
    assert "does not match" in (cap.check(OTHER, TID, clock=lambda: now) or "")
    moved = TransferCapability("decode-b", cap.expires_unix_ms, cap.mac)
    assert "does not match" in (moved.check(TOKEN, TID, clock=lambda: now) or "")
    later = TransferCapability(cap.receiver_id, cap.expires_unix_ms + 1000, cap.mac)
    assert "does not match" in (later.check(TOKEN, TID, clock=lambda: now) or "")
    expired_at = now + 60 + MAX_CLOCK_SKEW_S + 1
    assert "expired" in (cap.check(TOKEN, TID, clock=lambda: expired_at) or "")
    assert "no transfer capability" in (TransferCapability("", 0, "").check(TOKEN, TID) or "")


# -- signed registrations --------------------------------------------------------------------
def _info(address: str = "127.0.0.1:5000") -> InstanceInfo:
    return InstanceInfo.create(role="decode", address=address, model="m",
                               scheme=HashScheme(block_size=16))


@pytest.mark.fast
def test_registration_signature_covers_address_and_identity() -> None:
    info = _info()
    assert registration_problem(info, None) is None  # no token: trusted, as before
    assert registration_problem(info, TOKEN) == "unsigned"
    signed = sign_registration(info, TOKEN)
    assert registration_problem(signed, TOKEN) is None
    assert registration_problem(signed, OTHER) == "forged"
    again = InstanceInfo.from_fields(signed.instance_id, signed.to_fields())
    assert registration_problem(again, TOKEN) is None
    fields = signed.to_fields() | {"address": "10.6.6.6:5000"}
    moved = InstanceInfo.from_fields(signed.instance_id, fields)
    assert registration_problem(moved, TOKEN) == "forged"
    fields = signed.to_fields() | {"load": '{"running": 3}'}  # load is not signed
    assert registration_problem(InstanceInfo.from_fields(signed.instance_id, fields),
                                TOKEN) is None


@pytest.mark.redis
@pytest.mark.anyio
async def test_signed_registration_survives_redis(conn: RedisConnection) -> None:
    keys = KeySpace(model="m")
    registry = InstanceRegistry(conn, keys)
    signed = sign_registration(_info("127.0.0.1:5001"), TOKEN)
    await registry.register(signed)
    await registry.heartbeat(signed.instance_id, {"running": 1.0})
    (back,) = [i for i in await registry.live_instances() if i.instance_id == signed.instance_id]
    assert registration_problem(back, TOKEN) is None
    await registry.deregister(signed.instance_id)


# -- Redis credentials ------------------------------------------------------------------------
@pytest.mark.fast
def test_redis_credentials_come_from_files_or_env_never_the_url(tmp_path: Path) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text("pw-from-file\n")
    settings = RedisSettings.resolve("redis://127.0.0.1:1/0", password_file=str(secret), env={})
    assert settings.password == "pw-from-file" and "pw-from-file" not in repr(settings)
    settings = RedisSettings.resolve(
        "rediss://h:6380/0", env={"PDMESH_REDIS_PASSWORD": "pw", "PDMESH_REDIS_USERNAME": "u",
                                  "PDMESH_REDIS_CA": str(secret)})
    assert settings.client_options() == {"username": "u", "password": "pw",
                                         "ssl_ca_certs": str(secret)}
    with pytest.raises(ValueError, match="rediss://"):
        RedisSettings.resolve("redis://h:1/0", ca_file=str(secret), env={})
    assert redacted_url("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"


@pytest.mark.redis
@pytest.mark.anyio
async def test_redis_acl_user_and_password_from_a_file(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = RedisConnection.from_url(redis_server.url)
    await admin.call("acl", lambda r: r.execute_command(
        "ACL", "SETUSER", "pdmesh-acl", "on", ">acl-secret", "~*", "&*", "+@all"))
    await admin.aclose()
    secret = tmp_path / "redis-password"
    secret.write_text("acl-secret\n")
    monkeypatch.setenv("PDMESH_REDIS_USERNAME", "pdmesh-acl")
    conn = RedisConnection.from_url(redis_server.url, password_file=str(secret))
    try:
        registry = InstanceRegistry(conn, KeySpace(model="m"))
        info = _info("127.0.0.1:5002")
        await registry.register(info)  # Lua scripts and all, as the ACL user
        assert info.instance_id in [i.instance_id for i in await registry.live_instances()]
        await registry.deregister(info.instance_id)
        assert await conn.call("whoami", lambda r: r.execute_command("ACL", "WHOAMI")) \
            == "pdmesh-acl"
    finally:
        await conn.aclose()
    secret.write_text("wrong\n")
    wrong = RedisConnection.from_url(redis_server.url, password_file=str(secret))
    try:
        with pytest.raises(IndexUnavailable):
            await wrong.ping()
    finally:
        await wrong.aclose()


# -- the interceptor on a real server -----------------------------------------------------------
class _Decode(engine_pb2_grpc.DecodeServicer):
    async def GetLoad(self, request: engine_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> engine_pb2.EngineLoad:
        return engine_pb2.EngineLoad(instance_id="ok")


@pytest.fixture(name="server_address")
async def server_address_fixture() -> AsyncIterator[str]:
    server = grpc.aio.server(interceptors=server_interceptors(TOKEN))
    engine_pb2_grpc.add_DecodeServicer_to_server(_Decode(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


@pytest.mark.fast
@pytest.mark.anyio
async def test_internal_calls_need_the_token_health_does_not(server_address: str) -> None:
    async with grpc.aio.insecure_channel(server_address) as channel:
        stub = engine_pb2_grpc.DecodeStub(channel)
        for metadata in ((), ((METADATA_KEY, "w" * 40),)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetLoad(engine_pb2.GetLoadRequest(), metadata=metadata, timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Streaming methods are refused the same way.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Decode(engine_pb2.DecodeRequest(request_id="x"), timeout=5):
                pass
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        probe = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert probe.status == health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(
        server_address, interceptors=client_interceptors(TOKEN)
    ) as channel:
        stub = engine_pb2_grpc.DecodeStub(channel)
        load = await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
        assert load.instance_id == "ok"
        # A streaming call carries the token too (it reaches the servicer: UNIMPLEMENTED).
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Decode(engine_pb2.DecodeRequest(request_id="x"), timeout=5):
                pass
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
