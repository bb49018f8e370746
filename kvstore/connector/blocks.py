"""Blocks of the paged KV cache as units of transfer: runs, copies and per-block checksums.

The cache is one tensor `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`, so one
block's bytes are `2 * layers` contiguous pieces, one per (layer, K/V). Moving blocks between
two caches copies runs of consecutive ids with one strided `copy_` each, never a gathered
temporary (that would be a second copy of every byte). A block's checksum covers its pieces in
(layer, K/V) order, so it names the block's contents whichever cache holds it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from pdmesh.kvstore.transfer.checksum import ChecksumAlgo, checksum

try:
    import xxhash
except ImportError:  # pragma: no cover - exercised only on installs without xxhash
    xxhash = None


def runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """`(src_start, dst_start, length)` for maximal runs where both ids advance by one."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destinations")
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if out:
            s0, d0, n = out[-1]
            if s == s0 + n and d == d0 + n:
                out[-1] = (s0, d0, n + 1)
                continue
        out.append((int(s), int(d), 1))
    return out


def copy_blocks(dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor,
                src_ids: Sequence[int]) -> None:
    """dst[:, :, dst_ids] = src[:, :, src_ids], one strided copy per run (one copy of a byte)."""
    for s, d, n in runs(src_ids, dst_ids):
        dst[:, :, d:d + n].copy_(src[:, :, s:s + n], non_blocking=False)


def block_pieces(cache: torch.Tensor, block_id: int) -> Iterator[torch.Tensor]:
    """The 2 * layers contiguous pieces of one block, in checksum order."""
    layers = cache.shape[0]
    for layer in range(layers):
        for kv in range(2):
            yield cache[layer, kv, block_id]


def byte_view(cache: torch.Tensor) -> np.ndarray:
    """The CPU cache as numpy bytes `[layers, 2, blocks, block_bytes]` (no copy): slicing it
    costs a fraction of a torch index, which matters at 2 * layers pieces per block."""
    layers, _, blocks = cache.shape[:3]
    return cache.view(torch.uint8).numpy().reshape(layers, 2, blocks, -1)


def block_checksums(algo: ChecksumAlgo, cache: torch.Tensor,
                    block_ids: Sequence[int]) -> list[int]:
    """One 64-bit checksum per block. A device cache is copied to the host first (its blocks
    only), which is what a GPU sender pays for checking; CPU caches are hashed in place."""
    if cache.device.type != "cpu":
        ids = torch.tensor(list(block_ids), device=cache.device)
        host = cache.index_select(2, ids).cpu()
        return block_checksums(algo, host, range(len(block_ids)))
    data = byte_view(cache)
    pieces = [(layer, kv) for layer in range(data.shape[0]) for kv in range(2)]
    sums: list[int] = []
    if algo is ChecksumAlgo.XXH3_64 and xxhash is not None:
        for block_id in block_ids:
            h = xxhash.xxh3_64()
            for layer, kv in pieces:
                h.update(data[layer, kv, block_id])
            sums.append(h.intdigest())
        return sums
    for block_id in block_ids:
        crc = 0
        for layer, kv in pieces:
            crc = checksum(algo, memoryview(data[layer, kv, block_id])) ^ (
                (crc << 1) & 0xFFFFFFFFFFFFFFFF)
        sums.append(crc)
    return sums


def block_nbytes(cache: torch.Tensor) -> int:
    """Bytes of one block across every layer."""
    layers, _, _, block_size, heads, head_dim = cache.shape
    return int(layers * 2 * block_size * heads * head_dim * cache.element_size())


def on_device_of(cache: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Make the cache's device current on this thread (a connector or block-server thread
    starts on device 0, whatever `cuda:N` the engine runs on)."""
    if cache.device.type == "cuda":
        return torch.cuda.device(cache.device)
    return contextlib.nullcontext()
