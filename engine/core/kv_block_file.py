"""The disk tier's file format: one KV block per file, a small validated header, raw bytes.

A file is read back only into the process that wrote it, but it is still bytes on a shared
disk, so nothing in it is trusted: no pickle, no `torch.load`, only a fixed header that must
match what the reader expects (magic, version, dtype, block shape, the block hash it was asked
for, payload length, file length) followed by the block's raw bytes in (layer, K/V) order, the
order its checksum (kvstore/connector/blocks.py) covers. A mismatch of any field, or of the
checksum, makes the file a miss (`BlockFileError`), never an exception in the step.

    offset  size  field
    0       8     magic b"PDMKVBLK"
    8       2     version (1), little-endian like every field
    10      2     header length in bytes (this table, with the hash)
    12      16    dtype name, ASCII, NUL-padded ("float32", "bfloat16", ...)
    28      16    layers, block_size, kv_heads, head_dim (4 x u32)
    44      1     checksum algorithm code (kvstore/transfer/checksum.py ALGO_CODES)
    45      1     block-hash length h (<= 64)
    46      8     checksum (u64)
    54      8     payload length (u64)
    62      h     the block hash
    62+h    ...   payload
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from pdmesh.engine.block_hash import BlockHash
from pdmesh.kvstore.transfer.checksum import ALGO_CODES, ALGOS_BY_CODE, ChecksumAlgo

MAGIC = b"PDMKVBLK"
VERSION = 1
_FIXED = struct.Struct("<8sHH16s4IBBQQ")
MAX_HASH_LEN = 64


class BlockFileError(ValueError):
    """The file is not a block this reader may use (corrupt, foreign, or another shape)."""


@dataclass(frozen=True)
class BlockLayout:
    """What every block file of one engine has in common."""

    dtype: str
    layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    itemsize: int

    @property
    def payload_bytes(self) -> int:
        return (self.layers * 2 * self.block_size * self.kv_heads * self.head_dim
                * self.itemsize)


@dataclass(frozen=True)
class BlockFileHeader:
    algo: ChecksumAlgo
    checksum: int
    block_hash: BlockHash


def encode_header(layout: BlockLayout, header: BlockFileHeader) -> bytes:
    if len(header.block_hash) > MAX_HASH_LEN:
        raise ValueError(f"block hash of {len(header.block_hash)} bytes (at most {MAX_HASH_LEN})")
    size = _FIXED.size + len(header.block_hash)
    fixed = _FIXED.pack(MAGIC, VERSION, size, layout.dtype.encode("ascii"), layout.layers,
                        layout.block_size, layout.kv_heads, layout.head_dim,
                        ALGO_CODES[header.algo], len(header.block_hash), header.checksum,
                        layout.payload_bytes)
    return fixed + header.block_hash


def decode_header(data: bytes, layout: BlockLayout, block_hash: BlockHash) -> BlockFileHeader:
    """The header at the start of `data`, checked against the reader's layout and the hash it
    asked for; BlockFileError on any difference."""
    if len(data) < _FIXED.size:
        raise BlockFileError(f"{len(data)} bytes: too short for a header")
    (magic, version, size, dtype, layers, block_size, heads, head_dim, algo_code, hash_len,
     checksum, payload) = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise BlockFileError("not a KV block file (bad magic)")
    if version != VERSION:
        raise BlockFileError(f"block file version {version}, this reader knows {VERSION}")
    if hash_len > MAX_HASH_LEN or size != _FIXED.size + hash_len or len(data) < size:
        raise BlockFileError("inconsistent header length")
    found = (dtype.rstrip(b"\0").decode("ascii", "replace"), layers, block_size, heads,
             head_dim)
    wanted = (layout.dtype, layout.layers, layout.block_size, layout.kv_heads, layout.head_dim)
    if found != wanted:
        raise BlockFileError(f"block of {found}, this engine's blocks are {wanted}")
    if payload != layout.payload_bytes:
        raise BlockFileError(f"payload of {payload} bytes, expected {layout.payload_bytes}")
    if algo_code not in ALGOS_BY_CODE:
        raise BlockFileError(f"unknown checksum algorithm code {algo_code}")
    stored_hash = bytes(data[_FIXED.size:size])
    if stored_hash != block_hash:
        raise BlockFileError("the file holds another block hash")
    return BlockFileHeader(ALGOS_BY_CODE[algo_code], checksum, BlockHash(stored_hash))


def write_block_file(path: Path, layout: BlockLayout, header: BlockFileHeader,
                     payload: memoryview) -> None:
    """Write atomically (a temporary name, then rename): a reader never sees half a file."""
    if payload.nbytes != layout.payload_bytes:
        raise ValueError(f"payload of {payload.nbytes} bytes, layout says "
                         f"{layout.payload_bytes}")
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(encode_header(layout, header))
        f.write(payload)
    os.replace(tmp, path)


def read_block_file(path: Path, layout: BlockLayout, block_hash: BlockHash,
                    into: memoryview) -> BlockFileHeader:
    """Read the payload into `into` (exactly `payload_bytes`), returning the checked header;
    BlockFileError when the file is missing, short, long or foreign. The checksum of the
    payload is the caller's to verify (it hashes where the bytes landed)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_FIXED.size + MAX_HASH_LEN)
            header = decode_header(head, layout, block_hash)
            f.seek(_FIXED.size + len(header.block_hash))
            got = f.readinto(into)
            extra = f.read(1)
    except OSError as exc:
        raise BlockFileError(f"unreadable: {exc}") from None
    if got != layout.payload_bytes or extra:
        raise BlockFileError(f"payload of {got}{'+' if extra else ''} bytes, expected "
                             f"{layout.payload_bytes}")
    return header
