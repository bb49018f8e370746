"""Wire format of a KV payload: a fixed little-endian header, two ids, then raw tensor bytes.

    offset size field
    0      4    magic b"PDKV"
    4      2    version (1)
    6      2    header_len (fixed part + both ids)
    8      1    dtype code (layout.DTYPE_CODES)
    9      1    checksum algorithm code (checksum.ALGO_CODES)
    10     2    flags (0; reserved)
    12     24   num_layers, num_blocks, block_size, num_kv_heads, head_dim, num_tokens (u32)
    36     8    payload_len (u64) = prod(shape) * itemsize
    44     8    checksum of the payload (u64)
    52     2    request_id length (u16)
    54     2    transfer_id length (u16)
    56     ...  request_id, transfer_id (utf-8), then payload_len bytes of tensor data

The receiver validates the header against the handle it was given *before* writing payload
bytes anywhere, and the payload checksum before using them. Nothing here unpickles.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdmesh.kvstore.transfer.checksum import (
    ALGO_CODES,
    ALGOS_BY_CODE,
    ChecksumAlgo,
    checksum,
    tensor_bytes,
)
from pdmesh.kvstore.transfer.errors import KVChecksumError, KVHandleError, KVWireError
from pdmesh.kvstore.transfer.handle import MAX_ID_BYTES, KVHandle
from pdmesh.kvstore.transfer.layout import DTYPE_NAMES_BY_CODE, KVLayout

if TYPE_CHECKING:
    import torch

MAGIC = b"PDKV"
VERSION = 1
_FIXED = struct.Struct("<4sHHBBH6IQQHH")
FIXED_HEADER_BYTES = _FIXED.size
MAX_HEADER_BYTES = FIXED_HEADER_BYTES + 2 * MAX_ID_BYTES


@dataclass(frozen=True)
class WireHeader:
    transfer_id: str
    request_id: str
    layout: KVLayout
    checksum_algo: ChecksumAlgo
    checksum: int

    @classmethod
    def for_handle(cls, handle: KVHandle) -> WireHeader:
        return cls(
            handle.transfer_id, handle.request_id, handle.layout, handle.checksum_algo,
            handle.checksum,
        )

    @property
    def payload_len(self) -> int:
        return self.layout.nbytes


def encode_header(header: WireHeader) -> bytes:
    rid = header.request_id.encode()
    tid = header.transfer_id.encode()
    lay = header.layout
    fixed = _FIXED.pack(
        MAGIC, VERSION, FIXED_HEADER_BYTES + len(rid) + len(tid), lay.dtype_code,
        ALGO_CODES[header.checksum_algo], 0,
        lay.num_layers, lay.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim,
        lay.num_tokens, lay.nbytes, header.checksum, len(rid), len(tid),
    )
    return fixed + rid + tid


def header_length(prefix: bytes | memoryview) -> int:
    """Total header length announced by the first `FIXED_HEADER_BYTES` bytes of a stream."""
    if len(prefix) < FIXED_HEADER_BYTES:
        raise KVWireError(f"truncated header: {len(prefix)} of {FIXED_HEADER_BYTES} bytes")
    magic, version, header_len = struct.unpack_from("<4sHH", prefix)
    if magic != MAGIC:
        raise KVWireError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise KVWireError(f"unsupported wire version {version}, expected {VERSION}")
    if not FIXED_HEADER_BYTES < header_len <= MAX_HEADER_BYTES:
        raise KVWireError(f"header length {header_len} out of range")
    return header_len


def decode_header(data: bytes | memoryview) -> WireHeader:
    """Parse and validate a complete header (extra trailing bytes are ignored)."""
    header_len = header_length(data)
    if len(data) < header_len:
        raise KVWireError(f"truncated header: {len(data)} of {header_len} bytes")
    (
        _, _, _, dtype_code, algo_code, flags, layers, blocks, block_size, heads, head_dim,
        num_tokens, payload_len, value, rid_len, tid_len,
    ) = _FIXED.unpack_from(data)
    if flags != 0:
        raise KVWireError(f"unknown header flags {flags:#x}")
    if dtype_code not in DTYPE_NAMES_BY_CODE:
        raise KVWireError(f"dtype code {dtype_code} not in the whitelist")
    if algo_code not in ALGOS_BY_CODE:
        raise KVWireError(f"unknown checksum algorithm code {algo_code}")
    if FIXED_HEADER_BYTES + rid_len + tid_len != header_len:
        raise KVWireError("id lengths disagree with the header length")
    try:
        layout = KVLayout(layers, blocks, block_size, heads, head_dim,
                          DTYPE_NAMES_BY_CODE[dtype_code], num_tokens)
    except KVHandleError as exc:
        raise KVWireError(f"invalid layout in header: {exc}") from None
    if payload_len != layout.nbytes:
        raise KVWireError(
            f"payload length {payload_len} does not match shape {layout.shape} "
            f"{layout.dtype_name} ({layout.nbytes} bytes)"
        )
    ids = bytes(data[FIXED_HEADER_BYTES:header_len])
    try:
        request_id = ids[:rid_len].decode()
        transfer_id = ids[rid_len:].decode()
    except UnicodeDecodeError:
        raise KVWireError("ids are not valid utf-8") from None
    return WireHeader(transfer_id, request_id, layout, ALGOS_BY_CODE[algo_code], value)


def check_header(header: WireHeader, handle: KVHandle) -> None:
    """The bytes must belong to exactly the transfer the handle describes."""
    if header.request_id != handle.request_id:
        raise KVWireError(
            f"request id mismatch: got {header.request_id!r}, expected {handle.request_id!r}",
            transfer_id=handle.transfer_id, request_id=handle.request_id,
        )
    if header.transfer_id != handle.transfer_id:
        raise KVWireError(
            f"transfer id mismatch: got {header.transfer_id!r}",
            transfer_id=handle.transfer_id, request_id=handle.request_id,
        )
    if header.layout != handle.layout:
        raise KVWireError(
            f"layout mismatch: got {header.layout}, expected {handle.layout}",
            transfer_id=handle.transfer_id, request_id=handle.request_id,
        )
    if (header.checksum_algo, header.checksum) != (handle.checksum_algo, handle.checksum):
        raise KVWireError(
            "checksum in header differs from the handle's",
            transfer_id=handle.transfer_id, request_id=handle.request_id,
        )


def verify_payload(header: WireHeader, payload: memoryview | bytes) -> None:
    if len(payload) != header.payload_len:
        raise KVWireError(
            f"truncated payload: {len(payload)} of {header.payload_len} bytes",
            transfer_id=header.transfer_id, request_id=header.request_id,
        )
    actual = checksum(header.checksum_algo, payload)
    if actual != header.checksum:
        raise KVChecksumError(
            f"{header.checksum_algo} checksum mismatch: got {actual:016x}, "
            f"expected {header.checksum:016x}",
            transfer_id=header.transfer_id, request_id=header.request_id,
        )


def encode_frame(handle: KVHandle, kv: torch.Tensor) -> bytes:
    """Header plus payload in one buffer (a copy; data planes stream the two parts instead)."""
    handle.layout.check_tensor(kv)
    return encode_header(WireHeader.for_handle(handle)) + bytes(tensor_bytes(kv.cpu()))


def decode_frame(frame: bytes | memoryview, expected: KVHandle | None = None) -> torch.Tensor:
    """Validate a whole frame and return its tensor (a fresh copy owning its memory)."""
    view = memoryview(frame).cast("B")
    header = decode_header(view)
    if expected is not None:
        check_header(header, expected)
    payload = view[header_length(view):]
    if len(payload) > header.payload_len:
        raise KVWireError(f"{len(payload) - header.payload_len} trailing bytes after payload")
    verify_payload(header, payload)
    out = header.layout.empty()
    tensor_bytes(out)[:] = payload
    return out
