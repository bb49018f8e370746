"""Wire format, handle and layout validation of the KV-transfer layer (pure, no I/O)."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from pdmesh.kvstore.transfer.checksum import PAYLOAD_ALGOS, ChecksumAlgo, tensor_checksum
from pdmesh.kvstore.transfer.errors import KVChecksumError, KVHandleError, KVWireError
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.layout import KVLayout
from pdmesh.kvstore.transfer.wire import (
    FIXED_HEADER_BYTES,
    WireHeader,
    check_header,
    decode_frame,
    decode_header,
    encode_frame,
    encode_header,
    header_length,
)
from pdmesh.v1 import kv_transfer_pb2 as pb

pytestmark = pytest.mark.fast

TID = "0123456789abcdef0123456789abcdef"
# Offsets into the fixed header (see wire.py).
VERSION_AT, DTYPE_AT, PAYLOAD_LEN_AT, FLAGS_AT = 4, 8, 36, 10


def make_kv(dtype: torch.dtype = torch.float32, blocks: int = 3, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, blocks, 4, 2, 8, generator=generator).to(dtype)


def make_handle(
    kv: torch.Tensor,
    num_tokens: int = 10,
    request_id: str = "req-1",
    algo: ChecksumAlgo = ChecksumAlgo.XXH3_64,
) -> KVHandle:
    return KVHandle(
        transfer_id=TID,
        request_id=request_id,
        sender_address="127.0.0.1:5555",
        backends=("shm", "tcp"),
        host_key="host",
        sender_id="sender",
        layout=KVLayout.of(kv, num_tokens),
        checksum_algo=algo,
        checksum=tensor_checksum(algo, kv),
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def patched(frame: bytes, offset: int, fmt: str, value: int) -> bytes:
    data = bytearray(frame)
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("algo", PAYLOAD_ALGOS)
def test_frame_round_trip_is_bit_exact(dtype: torch.dtype, algo: ChecksumAlgo) -> None:
    kv = make_kv(dtype)
    handle = make_handle(kv, algo=algo)
    out = decode_frame(encode_frame(handle, kv), handle)
    assert out.dtype == dtype and out.shape == kv.shape
    assert torch.equal(bits(out), bits(kv))


def test_header_round_trip() -> None:
    handle = make_handle(make_kv(), request_id="réq-ü")
    header = WireHeader.for_handle(handle)
    data = encode_header(header)
    assert header_length(data[:FIXED_HEADER_BYTES]) == len(data)
    assert decode_header(data) == header
    check_header(decode_header(data), handle)


def test_bad_magic() -> None:
    kv = make_kv()
    frame = b"XXXX" + encode_frame(make_handle(kv), kv)[4:]
    with pytest.raises(KVWireError, match="magic"):
        decode_frame(frame)


def test_unsupported_version() -> None:
    kv = make_kv()
    frame = patched(encode_frame(make_handle(kv), kv), VERSION_AT, "<H", 99)
    with pytest.raises(KVWireError, match="version"):
        decode_frame(frame)


def test_unknown_flags() -> None:
    kv = make_kv()
    frame = patched(encode_frame(make_handle(kv), kv), FLAGS_AT, "<H", 1)
    with pytest.raises(KVWireError, match="flags"):
        decode_frame(frame)


@pytest.mark.parametrize("cut", [0, 3, FIXED_HEADER_BYTES - 1, FIXED_HEADER_BYTES + 2])
def test_truncated_header(cut: int) -> None:
    kv = make_kv()
    with pytest.raises(KVWireError, match="truncated"):
        decode_frame(encode_frame(make_handle(kv), kv)[:cut])


def test_truncated_payload() -> None:
    kv = make_kv()
    handle = make_handle(kv)
    with pytest.raises(KVWireError, match="truncated payload"):
        decode_frame(encode_frame(handle, kv)[:-1], handle)


def test_trailing_bytes() -> None:
    kv = make_kv()
    handle = make_handle(kv)
    with pytest.raises(KVWireError, match="trailing"):
        decode_frame(encode_frame(handle, kv) + b"\0", handle)


@pytest.mark.parametrize("algo", PAYLOAD_ALGOS)
def test_wrong_checksum(algo: ChecksumAlgo) -> None:
    kv = make_kv()
    handle = make_handle(kv, algo=algo)
    frame = bytearray(encode_frame(handle, kv))
    frame[-5] ^= 0x01  # one flipped bit in the payload
    with pytest.raises(KVChecksumError, match="checksum mismatch"):
        decode_frame(bytes(frame), handle)


def test_dtype_code_outside_whitelist() -> None:
    kv = make_kv()
    frame = patched(encode_frame(make_handle(kv), kv), DTYPE_AT, "<B", 9)
    with pytest.raises(KVWireError, match="whitelist"):
        decode_frame(frame)


def test_dtype_differs_from_handle() -> None:
    kv16 = make_kv(torch.float16)
    # Same shape, other dtype: the header is valid on its own but not what we asked for.
    expected = make_handle(make_kv(torch.bfloat16))
    with pytest.raises(KVWireError, match="layout mismatch"):
        decode_frame(encode_frame(make_handle(kv16), kv16), expected)


def test_payload_length_inconsistent_with_shape() -> None:
    kv = make_kv()
    frame = patched(encode_frame(make_handle(kv), kv), PAYLOAD_LEN_AT, "<Q", kv.numel() * 4 + 4)
    with pytest.raises(KVWireError, match="does not match shape"):
        decode_frame(frame)


def test_shape_differs_from_handle() -> None:
    kv = make_kv(blocks=3)
    expected = make_handle(make_kv(blocks=4), num_tokens=14)
    with pytest.raises(KVWireError, match="layout mismatch"):
        decode_frame(encode_frame(make_handle(kv), kv), expected)


def test_num_tokens_beyond_blocks_in_header() -> None:
    kv = make_kv(blocks=3)  # block size 4: at most 12 tokens
    frame = patched(encode_frame(make_handle(kv), kv), 32, "<I", 13)  # num_tokens field
    with pytest.raises(KVWireError, match="num_tokens"):
        decode_frame(frame)


def test_request_id_mismatch() -> None:
    kv = make_kv()
    frame = encode_frame(make_handle(kv, request_id="req-A"), kv)
    with pytest.raises(KVWireError, match="request id mismatch"):
        decode_frame(frame, make_handle(kv, request_id="req-B"))


def test_transfer_id_mismatch() -> None:
    kv = make_kv()
    handle = make_handle(kv)
    other = KVHandle(**{**handle.__dict__, "transfer_id": "f" * 32})
    with pytest.raises(KVWireError, match="transfer id mismatch"):
        decode_frame(encode_frame(handle, kv), other)


def test_checksum_in_header_differs_from_handle() -> None:
    kv = make_kv()
    handle = make_handle(kv)
    other = KVHandle(**{**handle.__dict__, "checksum": handle.checksum ^ 1})
    with pytest.raises(KVWireError, match="checksum in header"):
        decode_frame(encode_frame(handle, kv), other)


# -- handle -----------------------------------------------------------------------------------


def test_handle_dict_round_trip_through_json() -> None:
    handle = make_handle(make_kv(torch.bfloat16))
    assert KVHandle.from_dict(json.loads(json.dumps(handle.to_dict()))) == handle


def test_handle_proto_round_trip_through_bytes() -> None:
    handle = make_handle(make_kv(torch.float16), algo=ChecksumAlgo.CRC32)
    wire = handle.to_proto().SerializeToString()
    assert KVHandle.from_proto(pb.KVHandle.FromString(wire)) == handle


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("transfer_id", "xyz", "transfer_id"),
        ("request_id", "", "request_id"),
        ("request_id", "r" * 300, "request_id"),
        ("sender_address", "no-port", "sender_address"),
        ("sender_address", "host:99999", "port"),
        ("backends", ["carrier-pigeon"], "backends"),
        ("backends", [], "backends"),
        ("checksum_algo", "md5", "checksum"),
        ("checksum", "not-hex", "malformed"),
    ],
)
def test_invalid_handle_dicts_are_refused(field: str, value: object, match: str) -> None:
    data = make_handle(make_kv()).to_dict()
    data[field] = value
    with pytest.raises(KVHandleError, match=match):
        KVHandle.from_dict(data)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("dtype", "int8", "dtype"),
        ("num_layers", 0, "num_layers"),
        ("num_blocks", "3", "integer"),
        ("num_tokens", 13, "num_tokens"),  # 3 blocks of 4 hold at most 12
        ("num_tokens", 8, "num_tokens"),   # ...and the last block may not be empty
    ],
)
def test_invalid_layouts_are_refused(field: str, value: object, match: str) -> None:
    data = make_handle(make_kv()).to_dict()
    data["layout"][field] = value
    with pytest.raises(KVHandleError, match=match):
        KVHandle.from_dict(data)


def test_handle_missing_field() -> None:
    data = make_handle(make_kv()).to_dict()
    del data["sender_id"]
    with pytest.raises(KVHandleError, match="sender_id"):
        KVHandle.from_dict(data)


def test_proto_with_unknown_dtype_is_refused() -> None:
    msg = make_handle(make_kv()).to_proto()
    msg.layout.dtype = 42
    with pytest.raises(KVHandleError, match="dtype"):
        KVHandle.from_proto(msg)


def test_layout_of_requires_kv_shape() -> None:
    with pytest.raises(KVHandleError, match="layers, 2"):
        KVLayout.of(torch.zeros(2, 3, 1, 4, 2, 8), 4)
    layout = KVLayout.of(make_kv(), 10)
    with pytest.raises(KVHandleError, match="destination"):
        layout.check_tensor(torch.zeros(1))
    with pytest.raises(KVHandleError, match="contiguous"):
        layout.check_tensor(layout.empty().transpose(0, 1).contiguous().transpose(0, 1))
