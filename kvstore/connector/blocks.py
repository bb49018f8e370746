"""Blocks of the paged KV cache as units of transfer: runs, copies and per-block checksums.

The cache is one tensor `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`, so one
block's bytes are `2 * layers` contiguous pieces, one per (layer, K/V). Moving blocks between
two caches copies runs of consecutive ids with one strided `copy_` each, never a gathered
temporary (that would be a second copy of every byte). A block's checksum covers its pieces in
(layer, K/V) order, so it names the block's contents whichever cache holds it. Where the native
CPU kernels load (`kernels/cpu_native.py`), xxh64 hashes a list of blocks in one call, and a
same-host pull copies and hashes in one pass (`copy_blocks_checked`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import numpy as np
import torch

from pdmesh.kernels import cpu_native
from pdmesh.kvstore.transfer.checksum import XXHASH_ALGOS, ChecksumAlgo, checksum, default_algo

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


def byte_view(cache: torch.Tensor) -> np.ndarray:
    """The CPU cache as numpy bytes `[layers, 2, blocks, block_bytes]` (no copy): slicing it
    costs a fraction of a torch index, which matters at 2 * layers pieces per block."""
    layers, _, blocks = cache.shape[:3]
    return cache.view(torch.uint8).numpy().reshape(layers, 2, blocks, -1)


def block_checksums(algo: ChecksumAlgo, cache: torch.Tensor,
                    block_ids: Sequence[int]) -> list[int]:
    """One 64-bit checksum per block. xxh64, xxh3 and crc32 hash a CPU cache in place (a
    device cache's blocks are copied to the host first), xxh64 in one native call where the
    kernels load; lin64 reduces on the cache's own device."""
    if algo is ChecksumAlgo.LIN64:
        return lin64_checksums(cache, block_ids)
    if cache.device.type != "cpu":  # a few blocks at a time: the host copy is a temporary
        ids = list(block_ids)
        sums = []
        for start in range(0, len(ids), DEVICE_CHUNK_BLOCKS):
            part = torch.tensor(ids[start:start + DEVICE_CHUNK_BLOCKS], device=cache.device)
            sums += block_checksums(algo, cache.index_select(2, part).cpu(), range(len(part)))
        return sums
    if algo is ChecksumAlgo.XXH64 and cpu_native.supports_kv_blocks(cache):
        return cpu_native.kv_blocks_xxh64(cache, block_ids)
    data = byte_view(cache)
    pieces = [(layer, kv) for layer in range(data.shape[0]) for kv in range(2)]
    sums: list[int] = []
    if algo in XXHASH_ALGOS and xxhash is not None:
        new_hash = xxhash.xxh64 if algo is ChecksumAlgo.XXH64 else xxhash.xxh3_64
        for block_id in block_ids:
            h = new_hash()
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


def copy_blocks_checked(algo: ChecksumAlgo, dst: torch.Tensor, dst_ids: Sequence[int],
                        src: torch.Tensor, src_ids: Sequence[int]) -> list[int]:
    """`copy_blocks`, then the checksum of each block as it landed in `dst`. For xxh64 between
    CPU caches the native pull hashes each stripe as it stores it: one pass over the bytes
    instead of a copy and then a second read of everything copied."""
    if algo is ChecksumAlgo.XXH64 and cpu_native.supports_kv_blocks(dst, src):
        return cpu_native.kv_copy_blocks_xxh64(dst, dst_ids, src, src_ids)
    copy_blocks(dst, dst_ids, src, src_ids)
    return block_checksums(algo, dst, dst_ids)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_mismatch(cache: torch.Tensor, layout: tuple[int, ...], dtype: str,
                    ours: tuple[int, ...] | None = None) -> str | None:
    """Why a pull that expects blocks of `layout` (layers, block size, KV heads, head dim)
    and `dtype` cannot be served from `cache` (whose blocks are `ours` where it is one rank's
    of several), or None when it can."""
    ours = ours or (cache.shape[0], *cache.shape[3:])
    our_dtype = dtype_name(cache.dtype)
    if tuple(layout) != ours or dtype != our_dtype:
        return (f"layout mismatch: the pull expects {tuple(layout)} {dtype}, this cache is "
                f"{ours} {our_dtype}")
    return None


def block_nbytes(cache: torch.Tensor) -> int:
    """Bytes of one block across every layer."""
    layers, _, _, block_size, heads, head_dim = cache.shape
    return int(layers * 2 * block_size * heads * head_dim * cache.element_size())


def device_uuid(device: torch.device) -> str:
    """A GPU's identity across processes (their `CUDA_VISIBLE_DEVICES` may number it
    differently); "" for a CPU."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def on_device_of(cache: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Make the cache's device current on this thread (a connector or block-server thread
    starts on device 0, whatever `cuda:N` the engine runs on)."""
    if cache.device.type == "cuda":
        return torch.cuda.device(cache.device)
    return contextlib.nullcontext()


def sending_stream(cache: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Where a sender reads its exported blocks on the device: a stream of its own. Those
    blocks are complete (an export's checksums were read on the model's stream and answered
    to the host before any grant names them), so nothing needs to order these reads after the
    engine's queued steps, which a connector thread's current stream, the device's default
    one, makes every copy and every `synchronize` wait for: a pull from a busy engine would
    wait about a step per piece. (A receiver's stream must wait for them first:
    `receiving_stream`.)"""
    if cache.device.type == "cuda":
        return torch.cuda.stream(torch.cuda.Stream(cache.device))
    return contextlib.nullcontext()


def receiving_stream(cache: torch.Tensor,
                     after: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
    """Where a receiver writes pulled blocks into a device cache: a stream of its own that
    first waits, on the device, for what `after` (the engine's model stream) has queued when
    the pull begins: a block it lands in may have been freed by a request whose last step is
    still in flight and writes it (async scheduling computes one token past a stop). Nothing
    the engine queues later holds the pull up; on the default stream every piece's copy waited
    for the engine's next step, and NCCL's wait made the model's stream wait for the transfer.
    The pull's checks read on the same stream, after its writes."""
    if cache.device.type != "cuda":
        return contextlib.nullcontext()
    side = torch.cuda.Stream(cache.device)
    side.wait_stream(after if after is not None else torch.cuda.current_stream(cache.device))
    return torch.cuda.stream(side)


DEVICE_CHUNK_BLOCKS = 16
"""Blocks of a device cache checked at once: their temporary (lin64's int64 words, or the host
copy the other algorithms hash) is this many blocks, not the whole list."""


def default_block_algo(cache: torch.Tensor) -> ChecksumAlgo:
    """What a core checks its blocks with: on the device for a GPU cache (when its pieces are
    whole 32-bit words); xxh64 for a CPU cache the native kernels can hash (a call per list of
    blocks, where xxh3 costs a Python call per piece); else xxh3 (crc32 without `xxhash`).
    Whoever pulls checks with the exporter's choice, so both ends must know it (`parse_algo`)."""
    piece_bytes = cache[0, 0, 0].numel() * cache.element_size()
    if cache.device.type == "cuda" and piece_bytes % 4 == 0:
        return ChecksumAlgo.LIN64
    if xxhash is not None and cpu_native.supports_kv_blocks(cache):
        return ChecksumAlgo.XXH64
    return default_algo()


@functools.lru_cache(maxsize=8)
def _lin64_weights(num_words: int, device: torch.device) -> torch.Tensor:
    """Odd 64-bit weights, one per 32-bit word of a block (splitmix64 of the position): a
    changed word always changes the sum, and so does a word moved to another position."""
    z = np.arange(1, num_words + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = (z ^ (z >> np.uint64(31))) | np.uint64(1)
    return torch.from_numpy(z.view(np.int64)).to(device)


def lin64_checksums(cache: torch.Tensor, block_ids: Sequence[int]) -> list[int]:
    """sum(word_k * weight_k) mod 2^64 over each block's 32-bit words, in (layer, K/V, piece)
    order: integer arithmetic, so every device and every reduction order agrees."""
    layers = cache.shape[0]
    words = cache.reshape(*cache.shape[:3], -1).view(torch.uint8).view(torch.int32)
    weights = _lin64_weights(layers * 2 * words.shape[-1], cache.device).view(
        layers, 2, 1, -1)
    ids = list(block_ids)
    out: list[int] = []
    with torch.no_grad():
        for start in range(0, len(ids), DEVICE_CHUNK_BLOCKS):
            chunk = torch.tensor(ids[start:start + DEVICE_CHUNK_BLOCKS], device=cache.device)
            picked = words.index_select(2, chunk).to(torch.int64)
            sums = (picked * weights).sum(dim=(0, 1, 3))
            out += [int(v) & 0xFFFFFFFFFFFFFFFF for v in sums.tolist()]
    return out
