"""Chained block hashes: the versioned contract behind prefix caching, local and cluster-wide.

A block's hash covers its parent's hash, its token ids and any extra keys that change the KV
(a per-tenant cache salt on the first block). The chain starts from a *fixed* root derived from
the scheme itself, so every process that uses the same scheme computes the same hashes —
a random root (vLLM's old default) makes cross-process sharing silently miss. Every instance
publishes `HashScheme.fingerprint()`; the cluster index refuses instances whose fingerprint
differs instead of serving 0 % hits with a 200 OK.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

SCHEME_VERSION = 1
SUPPORTED_ALGORITHMS = ("sha256", "blake2b")
DEFAULT_ROOT_SEED = "pdmesh"


@dataclass(frozen=True)
class HashScheme:
    """Everything that must agree between engines and the index for hashes to match."""

    block_size: int
    algorithm: str = "sha256"
    root_seed: str = DEFAULT_ROOT_SEED
    version: int = SCHEME_VERSION

    def __post_init__(self) -> None:
        if self.algorithm not in SUPPORTED_ALGORITHMS:
            raise ValueError(
                f"hash algorithm must be one of {SUPPORTED_ALGORITHMS}, got {self.algorithm!r}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def describe(self) -> str:
        return (
            f"pdmesh-block-hash/v{self.version}/{self.algorithm}"
            f"/bs={self.block_size}/root={self.root_seed}"
        )

    def fingerprint(self) -> str:
        """A short stable id of the scheme; equal fingerprints mean equal hashes."""
        return hashlib.sha256(self.describe().encode()).hexdigest()[:16]

    def digest(self, data: bytes) -> BlockHash:
        if self.algorithm == "sha256":
            return BlockHash(hashlib.sha256(data).digest())
        return BlockHash(hashlib.blake2b(data, digest_size=32).digest())

    @property
    def root(self) -> BlockHash:
        return self.digest(self.describe().encode())


def _encode_extra_keys(extra_keys: Sequence[str | int | bytes]) -> bytes:
    out = bytearray()
    for key in extra_keys:
        if isinstance(key, bytes):
            raw, tag = key, b"b"
        elif isinstance(key, int):
            raw, tag = str(key).encode(), b"i"
        else:
            raw, tag = key.encode(), b"s"
        out += tag + struct.pack("<I", len(raw)) + raw
    return bytes(out)


def hash_block(
    scheme: HashScheme,
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[str | int | bytes] = (),
) -> BlockHash:
    """Hash one full block. `parent` is None for the first block of a sequence."""
    if len(token_ids) != scheme.block_size:
        raise ValueError(
            f"only full blocks are hashed: got {len(token_ids)} tokens, "
            f"block_size={scheme.block_size}"
        )
    parent_bytes = scheme.root if parent is None else parent
    payload = (
        parent_bytes
        + struct.pack(f"<{len(token_ids)}q", *token_ids)
        + _encode_extra_keys(extra_keys)
    )
    return scheme.digest(payload)


def first_block_extra_keys(cache_salt: str | None) -> tuple[str, ...]:
    """Extra keys for the first block: a cache salt isolates tenants' prefixes."""
    return ("salt", cache_salt) if cache_salt else ()


def hash_token_blocks(
    scheme: HashScheme,
    token_ids: Sequence[int],
    cache_salt: str | None = None,
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of every *full* block of `token_ids`, starting at block `start_block`.

    `parent` must be the hash of block `start_block - 1` when `start_block > 0`; this lets a
    growing sequence hash only its new blocks.
    """
    bs = scheme.block_size
    hashes: list[BlockHash] = []
    for i in range(start_block, len(token_ids) // bs):
        extra = first_block_extra_keys(cache_salt) if i == 0 else ()
        parent = hash_block(scheme, parent, token_ids[i * bs : (i + 1) * bs], extra)
        hashes.append(parent)
    return hashes
