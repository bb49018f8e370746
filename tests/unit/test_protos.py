"""The pdmesh.v1 contracts: committed stubs are current, messages keep their meaning on the wire,
and the services can be served and called."""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import grpc
import pytest
from google.protobuf.message import Message

from pdmesh.v1 import (
    common_pb2,
    engine_pb2,
    router_pb2,
    router_pb2_grpc,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
PACKAGE_DIR = PROTO_ROOT / "pdmesh" / "v1"

M = TypeVar("M", bound=Message)


def _load_generate_script() -> ModuleType:
    """protos/generate.py is a script, not a package module; load it by path."""
    name = "pdmesh_protos_generate"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, PROTO_ROOT / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is needed to generate stubs")
    return _load_generate_script()


@pytest.fixture()
def proto_copy(tmp_path: Path) -> Path:
    """A private copy of the protos and their committed stubs, safe to damage."""
    target = tmp_path / "pdmesh" / "v1"
    target.mkdir(parents=True)
    for path in PACKAGE_DIR.iterdir():
        if path.suffix in (".proto", ".py", ".pyi") and path.name != "__init__.py":
            shutil.copy2(path, target / path.name)
    return tmp_path


# --- stubs are current -------------------------------------------------------------------


@pytest.mark.processes
def test_committed_stubs_are_current() -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is needed to generate stubs")
    proc = subprocess.run(
        [sys.executable, str(PROTO_ROOT / "generate.py"), "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.fast
def test_every_proto_has_all_three_stubs() -> None:
    protos = sorted(PACKAGE_DIR.glob("*.proto"))
    assert {"common.proto", "router.proto", "engine.proto"} <= {p.name for p in protos}
    for proto in protos:
        for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"):
            assert (PACKAGE_DIR / f"{proto.stem}{suffix}").is_file(), f"{proto.name}: {suffix}"


@pytest.mark.fast
def test_check_names_outdated_missing_and_orphaned_stubs(gen: ModuleType, proto_copy: Path) -> None:
    assert gen.find_stale(proto_copy) == []
    package = proto_copy / "pdmesh" / "v1"
    with (package / "router_pb2.py").open("a") as f:
        f.write("# hand edit\n")
    (package / "engine_pb2.pyi").unlink()
    (package / "gone_pb2.py").write_text("# stub of a deleted proto\n")

    stale = {(s.problem, s.path.name) for s in gen.find_stale(proto_copy)}

    assert stale == {
        ("outdated", "router_pb2.py"),
        ("missing", "engine_pb2.pyi"),
        ("orphaned", "gone_pb2.py"),
    }


@pytest.mark.fast
def test_check_catches_a_proto_edited_without_regenerating(
    gen: ModuleType, proto_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = proto_copy / "pdmesh" / "v1" / "common.proto"
    text = common.read_text()
    assert "  uint32 cached_prompt_tokens = 3;\n" in text
    common.write_text(text.replace("  uint32 cached_prompt_tokens = 3;\n", "", 1))

    rc = gen.main(["--check", "--proto-root", str(proto_copy)])

    err = capsys.readouterr().err
    assert rc == 1
    assert "outdated: pdmesh/v1/common_pb2.py" in err
    assert "cached_prompt_tokens" in err or "more diff lines" in err


@pytest.mark.fast
def test_write_repairs_the_tree(gen: ModuleType, proto_copy: Path) -> None:
    package = proto_copy / "pdmesh" / "v1"
    (package / "common_pb2.py").write_text("broken\n")
    (package / "gone_pb2_grpc.py").write_text("# orphan\n")
    untouched = (package / "router_pb2.py").stat().st_mtime_ns

    assert gen.main(["--proto-root", str(proto_copy)]) == 0

    assert gen.find_stale(proto_copy) == []
    assert not (package / "gone_pb2_grpc.py").exists()
    assert (package / "router_pb2.py").stat().st_mtime_ns == untouched  # current files kept


@pytest.mark.fast
def test_check_reports_protoc_errors(gen: ModuleType, proto_copy: Path) -> None:
    (proto_copy / "pdmesh" / "v1" / "broken.proto").write_text(
        'syntax = "proto3";\npackage pdmesh.v1;\nmessage Broken { int32 x = 1 }\n'
    )
    assert gen.main(["--check", "--proto-root", str(proto_copy)]) == 2


@pytest.mark.fast
def test_all_stub_modules_import_together() -> None:
    """Every proto of the package lands in one descriptor pool: duplicate names would fail here."""
    for path in sorted(PACKAGE_DIR.glob("*_pb2*.py")):
        importlib.import_module(f"pdmesh.v1.{path.stem}")


# --- messages keep their meaning on the wire ---------------------------------------------


def _round_trip(msg: M) -> M:
    again = type(msg).FromString(msg.SerializeToString())
    assert again == msg
    return again


@pytest.mark.fast
def test_unset_optional_sampling_fields_differ_from_zero() -> None:
    unset = _round_trip(common_pb2.SamplingParams())
    for field in (
        "temperature",
        "top_p",
        "repetition_penalty",
        "seed",
        "max_tokens",
        "logprobs",
        "prompt_logprobs",
        "skip_special_tokens",
    ):
        assert not unset.HasField(field), field

    zeros = _round_trip(
        common_pb2.SamplingParams(
            temperature=0.0, seed=0, logprobs=0, prompt_logprobs=0, skip_special_tokens=False
        )
    )
    assert zeros.HasField("temperature") and zeros.temperature == 0.0  # greedy, not default 1.0
    assert zeros.HasField("seed") and zeros.seed == 0
    assert zeros.HasField("logprobs") and zeros.logprobs == 0  # sampled token's logprob only
    assert zeros.HasField("skip_special_tokens") and zeros.skip_special_tokens is False


@pytest.mark.fast
def test_full_sampling_params_round_trip() -> None:
    params = common_pb2.SamplingParams(
        n=3,
        temperature=0.7,
        top_p=0.9,
        top_k=-1,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        logit_bias={0: -100.0, 49151: 5.5},
        seed=-(2**63),
        stop=["\n\n", "</s>"],
        stop_token_ids=[2, 0],
        include_stop_str_in_output=True,
        ignore_eos=True,
        max_tokens=4096,
        min_tokens=4,
        logprobs=20,
        prompt_logprobs=5,
        skip_special_tokens=True,
    )
    again = _round_trip(params)
    assert dict(again.logit_bias) == {0: -100.0, 49151: 5.5}
    assert again.seed == -(2**63)
    assert list(again.stop) == ["\n\n", "</s>"]


@pytest.mark.fast
def test_generate_request_prompt_oneof() -> None:
    chat = router_pb2.Chat(
        messages=[
            router_pb2.ChatMessage(role="system", content="Be brief."),
            router_pb2.ChatMessage(role="user", content="Grüße, 世界 👋"),
        ]
    )
    req = _round_trip(router_pb2.GenerateRequest(model="smollm2", chat=chat, stream=True))
    assert req.WhichOneof("prompt") == "chat"
    assert req.chat.messages[1].content == "Grüße, 世界 👋"
    assert not req.chat.HasField("add_generation_prompt")  # unset means true

    req.token_ids.ids.extend([1, 2, 3])  # setting another member clears the chat
    req = _round_trip(req)
    assert req.WhichOneof("prompt") == "token_ids"
    assert not req.HasField("chat")
    assert list(req.token_ids.ids) == [1, 2, 3]

    empty_ids = _round_trip(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds()))
    assert empty_ids.WhichOneof("prompt") == "token_ids"  # an empty prompt is still a choice


def _logprob(token_id: int, logprob: float, rank: int, text: str) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=token_id,
        logprob=logprob,
        rank=rank,
        text=text,
        top=[
            common_pb2.TokenLogprob.Candidate(token_id=7, logprob=-0.25, text="the"),
            common_pb2.TokenLogprob.Candidate(token_id=token_id, logprob=logprob, text=text),
        ],
    )


@pytest.mark.fast
def test_generate_stream_messages_round_trip() -> None:
    delta = router_pb2.GenerateResponse(
        delta=common_pb2.SequenceDelta(
            index=1,
            token_ids=[11, 12],
            text=" wor",
            logprobs=[_logprob(11, -1.5, 2, " w"), _logprob(12, -0.1, 1, "or")],
        )
    )
    again = _round_trip(delta)
    assert again.WhichOneof("event") == "delta"
    assert not again.delta.HasField("finish")  # not the last delta of index 1
    assert again.delta.logprobs[0].top[1].text == " w"

    last = _round_trip(
        router_pb2.GenerateResponse(
            delta=common_pb2.SequenceDelta(
                index=1,
                finish=common_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP, stop_token_id=0),
            )
        )
    )
    assert last.delta.HasField("finish")
    assert last.delta.finish.WhichOneof("stop_reason") == "stop_token_id"
    assert last.delta.finish.stop_token_id == 0  # token 0 is a real id, not "unset"

    result = _round_trip(
        router_pb2.GenerateResponse(
            result=router_pb2.GenerateResult(
                request_id="req-1",
                usage=common_pb2.Usage(
                    prompt_tokens=100, completion_tokens=9, cached_prompt_tokens=64
                ),
                prompt_logprobs=[_logprob(5, -3.0, 40, "Hello")],
                timing=common_pb2.Timing(tokenize_ms=0.4, queue_ms=1.5, ttft_ms=20.0),
                served_by=router_pb2.ServedBy(
                    prefill_instance_id="prefill-a-1", decode_instance_id="decode-b-2"
                ),
            )
        )
    )
    assert result.WhichOneof("event") == "result"
    assert result.result.usage.cached_prompt_tokens == 64


@pytest.mark.fast
def test_finish_stop_reason_is_unset_on_eos() -> None:
    eos = _round_trip(common_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP))
    assert eos.WhichOneof("stop_reason") is None
    by_string = _round_trip(
        common_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP, stop_str="\n\n")
    )
    assert by_string.WhichOneof("stop_reason") == "stop_str"
    assert common_pb2.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
    assert {common_pb2.FinishReason.Name(v) for v in common_pb2.FinishReason.values()} == {
        "FINISH_REASON_UNSPECIFIED",
        "FINISH_REASON_STOP",
        "FINISH_REASON_LENGTH",
        "FINISH_REASON_ABORT",
        "FINISH_REASON_ERROR",
    }


def _kv_handle() -> Message:
    """The handle type is owned by kv_transfer.proto; only the fields every handle must carry."""
    handle = engine_pb2.PrefillResponse().kv
    handle.transfer_id = "t-0001"
    handle.request_id = "req-1"
    return handle


@pytest.mark.fast
def test_prefill_then_decode_handoff_round_trip() -> None:
    params = common_pb2.SamplingParams(n=2, temperature=0.8, seed=7, prompt_logprobs=1)
    prefill = _round_trip(
        engine_pb2.PrefillRequest(
            request_id="req-1",
            prompt_token_ids=list(range(100)),
            sampling=params,
            cache_salt="tenant-a",
            priority=-1,
        )
    )
    response = _round_trip(
        engine_pb2.PrefillResponse(
            request_id=prefill.request_id,
            first=[
                common_pb2.SequenceDelta(index=0, token_ids=[42], text=" Hi"),
                common_pb2.SequenceDelta(
                    index=1,
                    token_ids=[2],
                    finish=common_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP),
                ),
            ],
            prompt_logprobs=[_logprob(i, -1.0, 1, "x") for i in range(1, 100)],
            cached_prompt_tokens=64,
            kv=_kv_handle(),
            timing=common_pb2.Timing(queue_ms=2.0, prefill_ms=30.0),
            instance_id="prefill-a-1",
        )
    )
    decode = _round_trip(
        engine_pb2.DecodeRequest(
            request_id=prefill.request_id,
            prompt_token_ids=prefill.prompt_token_ids,
            sampling=prefill.sampling,
            cache_salt=prefill.cache_salt,
            priority=prefill.priority,
            remote_prefill=engine_pb2.RemotePrefill(
                kv=response.kv,
                first=response.first,
                cached_prompt_tokens=response.cached_prompt_tokens,
            ),
        )
    )
    assert decode.remote_prefill.kv == _kv_handle()
    assert [d.HasField("finish") for d in decode.remote_prefill.first] == [False, True]
    assert decode.sampling.seed == 7

    local = _round_trip(engine_pb2.DecodeRequest(request_id="req-2", prompt_token_ids=[1, 2]))
    assert not local.HasField("remote_prefill")  # absent = prefill locally


@pytest.mark.fast
def test_engine_info_and_load_round_trip() -> None:
    info = _round_trip(
        engine_pb2.EngineInfo(
            model="smollm2",
            instance_id="colocated-h-1-abc",
            role=engine_pb2.ROLE_COLOCATED,
            block_size=16,
            hash_scheme_fingerprint="0123456789abcdef",
            max_model_len=8192,
            kv_capacity_tokens=2**40,
            kv_backends=["shm", "tcp"],
        )
    )
    assert info.kv_capacity_tokens == 2**40
    load = _round_trip(
        engine_pb2.EngineLoad(
            instance_id=info.instance_id,
            role=info.role,
            num_running=3,
            num_waiting=1,
            kv_usage=0.5,
            num_free_blocks=10,
            num_total_blocks=20,
            num_pinned_blocks=2,
        )
    )
    assert engine_pb2.Role.Name(load.role) == "ROLE_COLOCATED"


# --- services -----------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize(
    ("module", "service", "methods"),
    [
        (
            router_pb2,
            "Router",
            {"Generate": True, "Tokenize": False, "Detokenize": False, "ListModels": False,
             "GetStatus": False},
        ),
        (
            engine_pb2,
            "Prefill",
            {
                "Prefill": False,
                "PrefillStream": True,
                "ReleaseKV": False,
                "Abort": False,
                "GetLoad": False,
                "GetInfo": False,
            },
        ),
        (
            engine_pb2,
            "Decode",
            {"Decode": True, "PrefillDone": False, "Abort": False, "GetLoad": False,
             "GetInfo": False},
        ),
    ],
)
def test_service_shapes(module: ModuleType, service: str, methods: dict[str, bool]) -> None:
    """Method set and which ones stream: the router and engines are written against this."""
    descriptor = module.DESCRIPTOR.services_by_name[service]
    assert descriptor.full_name == f"pdmesh.v1.{service}"
    actual = {m.name: m.server_streaming for m in descriptor.methods}
    assert actual == methods
    assert not any(m.client_streaming for m in descriptor.methods)
    grpc_module = importlib.import_module(f"{module.__name__}_grpc")
    for attr in (f"{service}Stub", f"{service}Servicer", f"add_{service}Servicer_to_server"):
        assert hasattr(grpc_module, attr), attr


class _TwoTokenRouter(router_pb2_grpc.RouterServicer):
    """Serves a fixed two-token answer: enough to drive the generated stubs over a real socket."""

    def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[router_pb2.GenerateResponse]:
        context.send_initial_metadata((("x-request-id", request.request_id or "gen-1"),))
        for i, (token, text) in enumerate([(101, "Hel"), (102, "lo")]):
            finish = common_pb2.Finish(reason=common_pb2.FINISH_REASON_LENGTH) if i == 1 else None
            yield router_pb2.GenerateResponse(
                delta=common_pb2.SequenceDelta(index=0, token_ids=[token], text=text, finish=finish)
            )
        yield router_pb2.GenerateResponse(
            result=router_pb2.GenerateResult(
                request_id=request.request_id,
                usage=common_pb2.Usage(
                    prompt_tokens=len(request.token_ids.ids), completion_tokens=2
                ),
            )
        )


@pytest.mark.e2e
def test_generated_stubs_serve_a_stream_over_loopback() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    router_pb2_grpc.add_RouterServicer_to_server(_TwoTokenRouter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            request = router_pb2.GenerateRequest(
                request_id="req-9",
                token_ids=router_pb2.TokenIds(ids=[1, 2, 3]),
                sampling=common_pb2.SamplingParams(max_tokens=2),
            )
            call = stub.Generate(request, timeout=10)
            responses = list(call)
            metadata = dict(call.initial_metadata())
        assert metadata["x-request-id"] == "req-9"
        deltas = [r.delta for r in responses if r.WhichOneof("event") == "delta"]
        assert "".join(d.text for d in deltas) == "Hello"
        assert deltas[-1].finish.reason == common_pb2.FINISH_REASON_LENGTH
        assert responses[-1].WhichOneof("event") == "result"
        assert responses[-1].result.usage.prompt_tokens == 3

        with (
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
            pytest.raises(grpc.RpcError) as err,
        ):
            router_pb2_grpc.RouterStub(channel).Tokenize(
                router_pb2.TokenizeRequest(text="hi"), timeout=10
            )
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(grace=None).wait(timeout=10)
