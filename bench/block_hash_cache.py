"""Where a KV handoff's per-block checksums meet the CPU caches: three probes of the native
block kernels (`kernels/csrc/kv_blocks_cpu.c`) on one process, SmolLM2-135M's layout (30 layers,
720 KiB per block), 64 blocks of a 512-block cache (47 MB), float32:

1. **idle**: the block hash and the copy-and-hash (a same-host pull) back to back, after a
   sleep, and after a busy wait of the same length, on 1 and 2 threads: what milliseconds of
   control plane between two reads of the same bytes cost them (a back-to-back `copy_` keeps
   its bytes in the last-level cache; on a shared host the neighbours' traffic does not);
2. **in step**: the sender's hash of each layer's pieces right after the layer wrote them
   (one thread, the data hot), summed over the layers, against hashing the 64 blocks after
   the step, from the last-level cache or after it was swept: whether a checksum computed
   inside the prefill step would be cheaper than the one after it;
3. **overlap**: the sender's hash and the receiver's copy-and-hash one after the other (two
   threads each) against at the same time (one thread each): whether a handoff that reports
   block ids before their checksums (the receiver copying while the sender hashes) would gain
   on this host.

    .venv/bin/python bench/block_hash_cache.py [--reps 21]

Every number is a median of --reps; the sweep reads 1.5x the largest CPU cache. Runs with a
core's OpenMP spin (GOMP_SPINCOUNT=10000, engine/worker/cpu_threads.py), restarting itself once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch

from pdmesh.engine.worker.cpu_threads import core_environment
from pdmesh.kernels import cpu_native

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transfer import last_level_cache_bytes  # bench/transfer.py, beside this

LAYERS, CACHE_BLOCKS, BLOCK, HEADS, HEAD_DIM, N = 30, 512, 16, 3, 64, 64


def median_ms(fn: Callable[[], object], reps: int, before: Callable[[], object] | None = None,
              threads: int = 2) -> float:
    times = []
    for _ in range(reps):
        torch.set_num_threads(2)
        if before is not None:
            before()
        torch.set_num_threads(threads)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.set_num_threads(2)
    return 1e3 * statistics.median(times)


def busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    if cpu_native.library() is None:
        sys.exit("the native CPU kernels did not load: nothing to probe")
    shape = (LAYERS, 2, CACHE_BLOCKS, BLOCK, HEADS, HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    src, dst = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    sweep = torch.empty(int(1.5 * last_level_cache_bytes()) // 4).normal_(generator=gen)
    ids = list(range(N))
    new = torch.randn((2, N, BLOCK, HEADS, HEAD_DIM), generator=gen)
    reps = args.reps

    def hash_() -> object:
        return cpu_native.kv_blocks_xxh64(src, ids)

    def copy_hash() -> object:
        return cpu_native.kv_copy_blocks_xxh64(dst, ids, src, ids)

    rows: list[tuple[str, str, float]] = []
    for threads in (1, 2):
        for name, fn in (("hash", hash_), ("copy-and-hash", copy_hash)):
            for when, before in (("back to back", None),
                                 ("after a 3 ms sleep", lambda: time.sleep(0.003)),
                                 ("after a 10 ms sleep", lambda: time.sleep(0.010)),
                                 ("after a 10 ms busy wait", lambda: busy_wait(0.010))):
                rows.append(("idle", f"{name}, {threads} thread(s), {when}",
                             median_ms(fn, reps, before, threads)))

    def step_writes(hash_each_layer: bool) -> float:
        """One simulated prefill step's KV writes; the per-layer hashes' time (1 thread)."""
        hashed = 0.0
        for layer in range(LAYERS):
            src[layer, :, :N].copy_(new)
            if hash_each_layer:
                torch.set_num_threads(1)
                start = time.perf_counter()
                cpu_native.kv_blocks_xxh64(src[layer:layer + 1], ids)
                hashed += time.perf_counter() - start
                torch.set_num_threads(2)
        return hashed

    in_step = [step_writes(True) for _ in range(reps)]
    rows.append(("in step", "each layer's pieces as written (1 thread, summed)",
                 1e3 * statistics.median(in_step)))
    rows.append(("in step", "after the step, from the last-level cache (2 threads)",
                 median_ms(hash_, reps, lambda: step_writes(False))))
    rows.append(("in step", "after the step, swept (2 threads)",
                 median_ms(hash_, reps, lambda: (step_writes(False), sweep.sum()))))

    def one_then_other() -> None:
        torch.set_num_threads(2)
        hash_()
        copy_hash()

    def side_by_side() -> None:
        torch.set_num_threads(1)
        sender = threading.Thread(target=hash_)
        sender.start()
        copy_hash()
        sender.join()

    for when, before in (("hot", None), ("swept", lambda: sweep.sum())):
        rows.append(("overlap", f"hash then copy-and-hash (2 threads each), {when}",
                     median_ms(one_then_other, reps, before)))
        rows.append(("overlap", f"side by side (1 thread each), {when}",
                     median_ms(side_by_side, reps, before)))

    print(f"{N} blocks of {CACHE_BLOCKS} (SmolLM2-135M layout, float32, "
          f"{N * LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 4 / 1e6:.1f} MB), median of {reps}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    width = max(len(r[1]) for r in rows)
    print(f"| probe   | {'case'.ljust(width)} |     ms |")
    print(f"|---------|{'-' * (width + 2)}|-------:|")
    for probe, case, ms in rows:
        print(f"| {probe.ljust(7)} | {case.ljust(width)} | {ms:6.2f} |")


if __name__ == "__main__":
    environ = core_environment(os.environ)
    if environ != dict(os.environ):  # libgomp reads its spin when it loads: restart once
        os.execve(sys.executable, [sys.executable, *sys.argv], environ)
    main()
