"""What a load is told about its source, and what it reports back.

The decode serving process starts a transfer on the control plane (StartTransfer) and hands
its core a `KVSource`: the transport and the parameters the sender's control plane returned,
the per-block checksums from the handle and the layout to check. The core pulls the blocks it
lacks straight into its cache and answers with a `LoadResult`.
"""

from __future__ import annotations

import msgspec

from pdmesh.kvstore.transfer.errors import KVWireError

WORKER_BACKENDS = ("shm", "tcp", "torch_dist", "ucxx")
"""Transports an engine core runs itself."""


class KVSource(msgspec.Struct, frozen=True):
    backend: str                  # one of WORKER_BACKENDS
    params: dict[str, str]        # from the sender's StartTransfer reply
    block_checksums: list[int]    # one per exported block, in prompt order
    checksum_algo: str
    num_tokens: int               # prompt tokens the export covers
    kv_shape: tuple[int, int, int, int]  # (layers, block_size, kv_heads, head_dim)
    kv_dtype: str
    deadline_s: float = 30.0      # for the whole load, from when the core starts it
    streamed: bool = False
    """The export still grows (its prefill is running): `block_checksums` (and an shm
    source's `blocks`) cover only the blocks ready so far; the rest arrive as
    `ExportProgress` (`EngineCore.kv_stream`), and the first tokens once the prefill ends."""


class LoadResult(msgspec.Struct):
    """`reused_blocks` came from this core's own prefix cache, `pulled_blocks` over the wire;
    `error` is empty on success (the request then recomputes what it lacks)."""

    reused_blocks: int = 0
    pulled_blocks: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""
    reason: str = ""              # a low-cardinality label for a failure
    streamed: bool = False        # pulled from a growing export, batch by batch
    pulled_before_seal: int = 0   # blocks whose pull started before the prefill ended


def check_params(params: dict[str, str], names: tuple[str, ...]) -> None:
    """KVWireError naming the parameters a sender's StartTransfer reply left out."""
    missing = [n for n in names if not params.get(n)]
    if missing:
        raise KVWireError(f"KV source parameters missing: {', '.join(missing)}")


def encode_blocks(block_ids: tuple[int, ...] | list[int]) -> str:
    """An shm source's block ids as its `blocks` parameter."""
    return ",".join(str(b) for b in block_ids)


def decode_blocks(text: str, num_cache_blocks: int) -> list[int]:
    """An shm source's `blocks` parameter, each id checked against the peer's cache."""
    try:
        ids = [int(b) for b in text.split(",")] if text else []
    except ValueError:
        raise KVWireError("shm source: block ids are not integers") from None
    if any(not 0 <= b < num_cache_blocks for b in ids):
        raise KVWireError(f"shm source: a block id outside the peer's {num_cache_blocks} blocks")
    return ids
