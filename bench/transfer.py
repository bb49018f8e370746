"""KV-transfer throughput of every available backend, beside a local memory copy.

The sender runs in a second process (spawned), the receiver here; each measurement is one
complete `KVReceiver.fetch` into a preallocated destination (control RPCs, data plane,
checksum verification and ack included), on the SmolLM2-135M KV layout: 30 layers,
3 KV heads, head_dim 64, block size 16, float32 (720 KiB per block). The local limit is
`dst.copy_(src)` and `src.clone()` of the same bytes in this process.

The tcp backend is measured with and without mutual TLS (`--tls both`, rows `tcp` and
`tcp+tls`; certificates made for the run), so the cost of encrypting the KV data plane is
known.

    .venv/bin/python bench/transfer.py [--blocks 8,64,512] [--budget-s 3] [--tls off|on|both]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from pdmesh.grpc_common import TLSConfig
from pdmesh.kvstore.transfer.backends import available_backends
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.receiver import KVReceiver, KVReceiverConfig
from pdmesh.kvstore.transfer.sender import KVSender, KVSenderConfig

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def kv_shape(blocks: int) -> tuple[int, ...]:
    return (LAYERS, 2, blocks, BLOCK, HEADS, HEAD_DIM)


def sender_main(
    conn: Connection, backends: tuple[str, ...], shm_dir: str, tls: TLSConfig | None
) -> None:
    """Child process: publish KV on request, answer with the handle."""

    async def run() -> None:
        sender = KVSender(KVSenderConfig(backends=backends, shm_dir=shm_dir), lambda r, w: None,
                          tls=tls)
        await sender.start()
        loop = asyncio.get_running_loop()
        requests: asyncio.Queue[tuple | None] = asyncio.Queue()

        def pump() -> None:
            while True:
                try:
                    msg = conn.recv()
                except EOFError:
                    msg = None
                loop.call_soon_threadsafe(requests.put_nowait, msg)
                if msg is None:
                    return

        threading.Thread(target=pump, daemon=True).start()
        tensors: dict[int, torch.Tensor] = {}
        while (msg := await requests.get()) is not None:
            _, blocks, request_id = msg
            if blocks not in tensors:
                tensors[blocks] = torch.randn(kv_shape(blocks), generator=torch.Generator()
                                              .manual_seed(blocks))
            handle = sender.publish(request_id, tensors[blocks], blocks * BLOCK)
            conn.send(handle.to_dict())
        await sender.stop()

    asyncio.run(run())


def median_seconds(fn: Callable[[], object], reps: int, budget_s: float) -> float:
    fn()  # warm-up: page faults, connections
    times: list[float] = []
    stop = time.monotonic() + budget_s
    while len(times) < reps and (not times or time.monotonic() < stop):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_local(blocks: int, reps: int, budget_s: float) -> dict[str, float]:
    src = torch.randn(kv_shape(blocks))
    dst = torch.empty_like(src)
    return {
        "copy_": median_seconds(lambda: dst.copy_(src), reps, budget_s),
        "clone": median_seconds(src.clone, reps, budget_s),
    }


def bench_backend(
    conn: Connection, backend: str, blocks: int, reps: int, budget_s: float, shm_dir: str,
    tls: TLSConfig | None = None,
) -> float:
    counter = iter(range(1_000_000))

    async def run() -> float:
        async with KVReceiver(KVReceiverConfig(shm_dir=shm_dir), tls=tls) as receiver:
            out = torch.empty(kv_shape(blocks))
            times: list[float] = []
            stop = time.monotonic() + budget_s
            for i in range(reps + 1):  # the first one warms up
                conn.send(("publish", blocks, f"{backend}-{blocks}-{next(counter)}"))
                handle = KVHandle.from_dict(conn.recv())
                start = time.perf_counter()
                await receiver.fetch(handle, 60, out=out, backend=backend)
                if i > 0:
                    times.append(time.perf_counter() - start)
                if times and time.monotonic() > stop:
                    break
            return statistics.median(times)

    return asyncio.run(run())


@contextmanager
def sender_process(
    backends: tuple[str, ...], shm_dir: str, tls: TLSConfig | None
) -> Iterator[Connection]:
    """A sender child serving `backends`; yields the pipe that asks it to publish."""
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=sender_main, args=(child, backends, shm_dir, tls), daemon=True
    )
    proc.start()
    try:
        yield parent
    finally:
        parent.send(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def bench_certificates(directory: str) -> TLSConfig:
    """A CA and one service certificate (both ends use it), as the test suite makes them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
    from tests.certs import make_test_certs

    return make_test_certs(Path(directory)).tls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="8,64,512")
    parser.add_argument("--backends", default=",".join(available_backends()))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=3.0, help="per table cell")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--tls", choices=("off", "on", "both"), default="both",
                        help="tcp without TLS, with mutual TLS (row tcp+tls), or both")
    args = parser.parse_args()
    blocks_list = [int(b) for b in args.blocks.split(",")]
    backends = tuple(args.backends.split(","))
    if args.tls == "on":
        backends = tuple(b for b in backends if b != "tcp")
    torch.set_num_threads(max(1, torch.get_num_threads()))

    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="pdmesh-bench-", dir="/dev/shm") as shm_dir, \
            tempfile.TemporaryDirectory(prefix="pdmesh-bench-certs-") as cert_dir:
        # (row name, backend, TLS): every backend plain, then tcp under mutual TLS.
        runs: list[tuple[str, str, TLSConfig | None]] = [(b, b, None) for b in backends]
        if args.tls != "off" and "tcp" in available_backends():
            runs.append(("tcp+tls", "tcp", bench_certificates(cert_dir)))
        local = {blocks: bench_local(blocks, args.reps, args.budget_s) for blocks in blocks_list}
        for blocks, timings in local.items():
            for name, seconds in timings.items():
                rows.append({"path": f"local {name}", "blocks": blocks,
                             "bytes": torch.empty(kv_shape(blocks)).nbytes, "seconds": seconds})
        for tls in {id(t): t for _, _, t in runs}.values():
            served = tuple(b for _, b, t in runs if t is tls)
            with sender_process(served, shm_dir, tls) as conn:
                for row_name, backend, _ in (r for r in runs if r[2] is tls):
                    for blocks in blocks_list:
                        nbytes = torch.empty(kv_shape(blocks)).nbytes
                        seconds = bench_backend(conn, backend, blocks, args.reps,
                                                args.budget_s, shm_dir, tls)
                        rows.append({"path": row_name, "blocks": blocks, "bytes": nbytes,
                                     "seconds": seconds,
                                     "vs_copy": local[blocks]["copy_"] / seconds})

    print(f"KV transfer, SmolLM2-135M layout ({LAYERS} layers x 2 x {BLOCK} tokens x {HEADS} "
          f"heads x {HEAD_DIM} dims, float32), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"| {'path':<14} | {'blocks':>6} | {'MB':>7} | {'ms':>8} | {'GB/s':>6} | "
          f"{'of copy_':>8} |")
    print(f"|{'-' * 16}|{'-' * 8}:|{'-' * 9}:|{'-' * 10}:|{'-' * 8}:|{'-' * 10}:|")
    for row in sorted(rows, key=lambda r: (r["blocks"], str(r["path"]))):
        seconds, nbytes = float(row["seconds"]), int(row["bytes"])
        share = f"{float(row['vs_copy']):.0%}" if "vs_copy" in row else ""
        print(f"| {row['path']!s:<14} | {row['blocks']:>6} | {nbytes / 1e6:>7.1f} | "
              f"{seconds * 1e3:>8.2f} | {nbytes / seconds / 1e9:>6.2f} | {share:>8} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
