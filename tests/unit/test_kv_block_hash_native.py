"""Per-block XXH64 of a KV cache (kernels/csrc/kv_blocks_cpu.c through kernels/cpu_native.py,
used by kvstore/connector/blocks.py): the native digests equal the `xxhash` package's over each
block's concatenated (layer, K/V) pieces, the fused pull copies exactly and answers the same
digests, and the Python fallback agrees with both."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import xxhash

from pdmesh.kernels import cpu_native
from pdmesh.kvstore.connector.blocks import (
    block_checksums,
    copy_blocks_checked,
    default_block_algo,
)
from pdmesh.kvstore.transfer.checksum import (
    ALGO_CODES,
    ALGOS_BY_CODE,
    ChecksumAlgo,
    checksum,
    parse_algo,
)
from pdmesh.kvstore.transfer.errors import KVHandleError

pytestmark = pytest.mark.fast

XXH64 = ChecksumAlgo.XXH64

# (shape [layers, 2, blocks, block_size, heads, head_dim], dtype): pieces of 256 B (whole
# stripes), 30 B and 7 B (under a stripe: the carry crosses pieces), 100 B (stripes and a
# tail), 3,072 B in bfloat16.
CASES = [
    ((3, 2, 24, 4, 2, 8), torch.float32),
    ((2, 2, 5, 3, 1, 5), torch.float16),
    ((4, 2, 6, 7, 1, 1), torch.uint8),
    ((2, 2, 9, 5, 1, 5), torch.float32),
    ((5, 2, 3, 16, 3, 32), torch.bfloat16),
]
IDS = [[], [0], [2, 0, 1], [1, 1], None]  # None: every block, in order


def random_cache(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g).to(dtype)


def reference(cache: torch.Tensor, block_ids: list[int]) -> list[int]:
    """XXH64 of each block's pieces concatenated, by the `xxhash` package."""
    layers = cache.shape[0]
    return [xxhash.xxh64(b"".join(cache[layer, kv, b].contiguous().view(torch.uint8)
                                  .numpy().tobytes()
                                  for layer in range(layers) for kv in range(2))).intdigest()
            for b in block_ids]


def ids_for(cache: torch.Tensor, ids: list[int] | None) -> list[int]:
    return list(range(cache.shape[2])) if ids is None else ids


needs_native = pytest.mark.skipif(cpu_native.library() is None,
                                  reason="no C compiler and no prebuilt kernels here")


@needs_native
@pytest.mark.parametrize(("shape", "dtype"), CASES)
@pytest.mark.parametrize("ids", IDS)
def test_native_xxh64_equals_the_xxhash_package(shape, dtype, ids) -> None:
    cache = random_cache(shape, dtype, seed=1)
    block_ids = ids_for(cache, ids)
    assert cpu_native.supports_kv_blocks(cache)
    assert cpu_native.kv_blocks_xxh64(cache, block_ids) == reference(cache, block_ids)
    assert block_checksums(XXH64, cache, block_ids) == reference(cache, block_ids)


@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_the_python_fallback_gives_the_same_digests(shape, dtype, monkeypatch) -> None:
    cache = random_cache(shape, dtype, seed=2)
    block_ids = [cache.shape[2] - 1, 0, 1]
    native = (block_checksums(XXH64, cache, block_ids)
              if cpu_native.supports_kv_blocks(cache) else None)
    monkeypatch.setattr(cpu_native, "supports_kv_blocks", lambda *caches: False)
    fallback = block_checksums(XXH64, cache, block_ids)
    assert fallback == reference(cache, block_ids)
    if native is not None:
        assert fallback == native
    dst = torch.zeros((*shape[:2], shape[2] + 2, *shape[3:]), dtype=dtype)
    assert copy_blocks_checked(XXH64, dst, [4, 2, 3], cache, block_ids) == fallback
    for d, s in zip([4, 2, 3], block_ids, strict=True):
        assert torch.equal(dst[:, :, d], cache[:, :, s])


@needs_native
@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_the_fused_pull_copies_exactly_and_answers_the_digests(shape, dtype) -> None:
    src = random_cache(shape, dtype, seed=3)
    dst_shape = (*shape[:2], shape[2] + 3, *shape[3:])  # the two caches differ in block count
    dst = random_cache(dst_shape, dtype, seed=4)
    before = dst.clone()
    src_ids = [shape[2] - 1, 0, 2, 1]
    dst_ids = [0, dst_shape[2] - 1, 3, 4]
    sums = cpu_native.kv_copy_blocks_xxh64(dst, dst_ids, src, src_ids)
    assert sums == reference(src, src_ids)
    assert sums == block_checksums(XXH64, dst, dst_ids)
    for d, s in zip(dst_ids, src_ids, strict=True):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    untouched = [b for b in range(dst_shape[2]) if b not in dst_ids]
    assert torch.equal(dst[:, :, untouched], before[:, :, untouched])
    assert copy_blocks_checked(XXH64, dst, [], src, []) == []


@needs_native
def test_the_native_calls_refuse_ids_outside_before_writing() -> None:
    src, dst = random_cache(*CASES[0], seed=5), torch.zeros(CASES[0][0])
    with pytest.raises(IndexError, match="outside"):
        cpu_native.kv_blocks_xxh64(src, [0, 24])
    with pytest.raises(IndexError, match="outside"):
        cpu_native.kv_copy_blocks_xxh64(dst, [0, 1], src, [0, -1])
    with pytest.raises(IndexError, match="outside"):
        cpu_native.kv_copy_blocks_xxh64(dst, [0, 99], src, [0, 1])
    assert float(dst.abs().sum()) == 0.0  # checked before the first byte moved
    with pytest.raises(ValueError, match="blocks"):  # another block layout
        cpu_native.kv_copy_blocks_xxh64(dst, [0], src.to(torch.bfloat16), [0])


@needs_native
def test_the_native_hash_lets_other_threads_run() -> None:
    """ctypes drops the GIL for the call: a Python thread keeps ticking through the middle of
    one long call (holding the GIL, it could tick only at its edges)."""
    cache = random_cache((4, 2, 16, 16, 4, 64), torch.float32, seed=6)  # 4 MiB, 16 blocks
    ids = list(range(16))
    while True:  # repeat the ids until one call lasts long enough to look inside
        start = time.perf_counter()
        cpu_native.kv_blocks_xxh64(cache, ids)
        if time.perf_counter() - start > 0.05:
            break
        ids *= 4
    stamps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.0005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.01)
        start = time.perf_counter()
        cpu_native.kv_blocks_xxh64(cache, ids)
        end = time.perf_counter()
    finally:
        stop.set()
        ticker.join()
    margin = (end - start) / 4
    assert any(start + margin < t < end - margin for t in stamps)


def test_xxh64_is_a_new_wire_code_and_a_payload_hash() -> None:
    assert {ChecksumAlgo.XXH3_64: 1, ChecksumAlgo.CRC32: 2, ChecksumAlgo.LIN64: 3,
            XXH64: 4}.items() <= ALGO_CODES.items()
    assert ALGOS_BY_CODE[4] is XXH64
    assert parse_algo("xxh64") is XXH64
    assert checksum(XXH64, b"pdmesh") == xxhash.xxh64_intdigest(b"pdmesh")
    with pytest.raises(KVHandleError, match="'xxh65'"):  # what an older peer says of a new name
        parse_algo("xxh65")


def test_cpu_caches_default_to_xxh64_where_the_kernels_load() -> None:
    cache = torch.zeros((2, 2, 4, 4, 1, 8))
    expected = XXH64 if cpu_native.supports_kv_blocks(cache) else ChecksumAlgo.XXH3_64
    assert default_block_algo(cache) is expected
