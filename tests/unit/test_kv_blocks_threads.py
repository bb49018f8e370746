"""The native KV block hash and copy-and-hash spread their blocks over short-lived threads
(`kernels/csrc/kv_blocks_cpu.c`): whatever the thread count, more threads than blocks
included, every block lands once and gets the digest the `xxhash` package gives; and no
thread is left behind (nothing spins or lingers after the call)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch

from pdmesh.kernels import cpu_native

xxhash = pytest.importorskip("xxhash")

pytestmark = [pytest.mark.fast,
              pytest.mark.skipif(cpu_native.library() is None,
                                 reason="no C compiler and no prebuilt kernels here")]


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def digests(cache: torch.Tensor, ids: list[int]) -> list[int]:
    return [xxhash.xxh64(b"".join(cache[layer, kv, b].contiguous().view(torch.uint8).numpy()
                                  .tobytes() for layer in range(cache.shape[0])
                                  for kv in range(2))).intdigest() for b in ids]


@pytest.mark.parametrize("threads", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("shape", [(3, 2, 41, 4, 2, 8),    # 256-B pieces: groups of 4 blocks
                                   (2, 2, 17, 5, 1, 3)])   # 60-B pieces: one block at a time
def test_every_thread_count_copies_and_hashes_each_block_once(threads: int,
                                                              shape: tuple[int, ...]) -> None:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(threads)
    src = torch.randn(shape, generator=g)
    dst = torch.zeros(shape)
    n = shape[2] - 2
    src_ids = torch.randperm(shape[2], generator=g)[:n].tolist()
    dst_ids = torch.randperm(shape[2], generator=g)[:n].tolist()
    want = digests(src, src_ids)
    assert cpu_native.kv_blocks_xxh64(src, src_ids) == want
    assert cpu_native.kv_copy_blocks_xxh64(dst, dst_ids, src, src_ids) == want
    assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])
    untouched = sorted(set(range(shape[2])) - set(dst_ids))
    assert not dst[:, :, untouched].any()


def native_threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux /proc")
def test_a_connector_thread_keeps_no_team_of_workers() -> None:
    """Called from a thread of its own (as a connector's load thread calls it), the hash
    leaves no workers behind while that thread lives: OpenMP would keep a team for it."""
    torch.set_num_threads(4)
    cache = torch.randn(2, 2, 64, 4, 2, 8)
    hashed, finish = threading.Event(), threading.Event()

    def load_thread() -> None:
        cpu_native.kv_blocks_xxh64(cache, list(range(64)))
        hashed.set()
        finish.wait()

    before = native_threads()
    thread = threading.Thread(target=load_thread)
    thread.start()
    try:
        assert hashed.wait(30)
        assert native_threads() == before + 1  # the load thread alone
    finally:
        finish.set()
        thread.join()
