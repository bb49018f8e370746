"""KV handoff, prefill core's cache -> decode core's cache, beside a local memory copy.

SmolLM2-135M KV layout: 30 layers, 3 KV heads, head_dim 64, block size 16, float32 (720 KiB per
block). Both caches hold max(--blocks) blocks; a transfer of n blocks reads n block ids of the
sender's cache and writes n of the receiver's, each side a fixed shuffle of its cache (worst case
for runs of consecutive ids; `--ids consecutive`: 0..n-1 on both sides, one run). Rows:

* `local copy_` / `local clone`: `dst.copy_(src)` / `src.clone()` of the same bytes, contiguous,
  in one process, back to back: the reference (at 64 blocks its 94 MB can stay in a large
  last-level cache between rounds, which a handoff's bytes do not: the control plane runs
  between its reads). `local copy_ (cold)`: the same copy after a sweep through 1.5x the
  largest CPU cache (untimed) has evicted both tensors: the memory's speed.
* `staged shm|tcp` (today's path): a child process holding the prefill cache gathers the blocks
  (`cache.index_select(2, ids)`, the core's ReadKV) and `KVSender.publish`es them (whole-tensor
  checksum); here `KVReceiver.fetch` pulls them into a fresh tensor (verify, ack) and
  `dst_cache.index_copy_(2, dst_ids, kv)` imports them (the core's import). The ZeroMQ hops
  between each core and its serving process (the gathered KV out of the prefill core, the
  fetched KV into the decode core) are further copies NOT counted: these rows are a lower bound.
* `core shm|tcp` (the engine cores move the blocks, `kvstore/connector/`): the child's cache is a
  shared-memory file with a `KVConnector`; it `export`s the blocks (per-block checksums) and its
  `KVSender(core=CoreCache(...))` `publish_export`s them. Here, the decode core: `KVReceiver.begin`,
  `KVConnector.load` into this process's own shared cache (one copy, then per-block verify),
  `KVReceiver.finish` (ack). `core X (load only)` is the `load` alone, in the same rounds (the
  rest is control plane and export); `core export` is the child's `export` alone; `core X
  (ack, after)` the ack, awaited after the clock stopped (an engine sends it in the
  background, `CorePulls.finish_soon`: a first token does not wait for it).
* `core X (streamed)`: the same blocks as a one-chunk prompt's streamed export (the default
  P/D path, `PrefillStream`): announced when its prompt was scheduled, so StartTransfer and
  WatchTransfer are done while the chunk computes (untimed here, where no chunk computes);
  timed from the end of the chunk's step (the child told to checksum and seal) until the
  decode core's cache holds the verified blocks: the checksums, the sealed report over
  WatchTransfer, the pull.
* `core ucxx`: the cores' own UCX transport (`connector/ucx_blocks.py`): the child's core runs a
  ucxx listener, the pull is received straight into this process's cache (where the `ucxx`
  package is installed; `--backends ucxx` also gives today's `staged ucxx` row).
* `... tcp+tls`: tcp under mutual TLS (control channel, staged data plane, the core's block
  server; certificates made for the run). `--tls off|on|both` (on: no plaintext tcp rows).

The core rows check blocks with the sender core's default algorithm (`default_block_algo`: xxh64
where the native CPU kernels load, hashed in one call per export and, on `shm`, while the
receiver copies; else xxh3 from Python); `--checksum xxh3_64` measures the old choice.

Both processes run as engine core processes do, with their short OpenMP spin
(`engine/worker/cpu_threads.py`: GOMP_SPINCOUNT=10000 unless GOMP_SPINCOUNT or OMP_WAIT_POLICY
is set; libgomp reads it when it loads, so the bench restarts itself once with it): with
libgomp's default (~10 ms of spinning after every parallel region) one core's spin after its
export or load took a CPU from the other's on a 2-CPU host.

A staged round is timed here from the request to the child (a Pipe round trip) until the
destination cache holds the verified blocks (`fetch` includes its ack); a core round until the
decode core's cache holds the verified blocks, which is what a first token waits for (the
engine's kv_source message to its core, a few hundred bytes, is not counted). ms: median of up
to --reps rounds within --budget-s per cell, after a warm-up round. `of copy_` / `of cold
copy_`: local copy_ / copy_ (cold) ms / this ms. `vs staged`: staged ms / this ms, same
transport (above 1: faster than today).

    .venv/bin/python bench/transfer.py [--blocks 64,512] [--budget-s 3] [--reps 10]
        [--tls off|on|both] [--backends shm,tcp] [--ids shuffled|consecutive] [--threads N]
        [--checksum default|xxh64|xxh3_64|crc32|lin64] [--json rows.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from pdmesh.engine.worker.cpu_threads import core_environment
from pdmesh.grpc_common import TLSConfig
from pdmesh.kvstore.connector.blocks import default_block_algo
from pdmesh.kvstore.connector.cache_file import shared_zeros
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.connector import KVConnector
from pdmesh.kvstore.connector.export_info import ExportProgress
from pdmesh.kvstore.connector.grant_mac import new_key
from pdmesh.kvstore.connector.source import WORKER_BACKENDS, KVSource, encode_blocks
from pdmesh.kvstore.transfer.checksum import ChecksumAlgo, parse_algo
from pdmesh.kvstore.transfer.core_pull import CorePulls
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.layout import KVLayout
from pdmesh.kvstore.transfer.receiver import KVReceiver, KVReceiverConfig
from pdmesh.kvstore.transfer.sender import KVSender, KVSenderConfig
from pdmesh.kvstore.transfer.worker_planes import CoreCache

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
BLOCK_BYTES = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 4  # float32: 720 KiB
DEADLINE_S = 60.0  # bound on one round, and on any answer of the child
Timings = dict[str, float]


def kv_shape(blocks: int) -> tuple[int, ...]:
    return (LAYERS, 2, blocks, BLOCK, HEADS, HEAD_DIM)


def block_ids(cache_blocks: int, n: int, seed: int, shuffled: bool) -> list[int]:
    if not shuffled:
        return list(range(n))
    return torch.randperm(cache_blocks, generator=torch.Generator().manual_seed(seed))[:n].tolist()


@dataclass(frozen=True)
class Setup:
    """One sender child and the receiving side here: the transports, the cache, TLS."""

    staged: tuple[str, ...]  # KVSender.publish backends
    core: tuple[str, ...]    # the connector's own transports (of WORKER_BACKENDS)
    cache_blocks: int
    shuffled: bool
    shm_dir: str
    tls: TLSConfig | None
    threads: int
    checksum: ChecksumAlgo  # what the sender core's export checks blocks with

    def connector_config(self, *, tcp: bool = True, grant_secret: str = "") -> KVConnectorConfig:
        t = self.tls or TLSConfig()
        return KVConnectorConfig(shm_dir=self.shm_dir, tcp=tcp, grant_secret=grant_secret,
                                 ucx=bool(grant_secret) and "ucxx" in self.core,
                                 tls_cert=t.cert or "", tls_key=t.key or "", tls_ca=t.ca or "")


def sender_main(conn: Connection, setup: Setup) -> None:
    """Child process, the prefill core: one cache (a shared file, random contents), today's
    sender over it, and the core's connector and control-plane sender; publishes on request."""
    torch.set_num_threads(setup.threads)
    cache = shared_zeros(kv_shape(setup.cache_blocks), torch.float32, setup.shm_dir)
    connector = KVConnector(setup.connector_config(grant_secret=new_key()), cache.tensor, cache,
                            algo=setup.checksum)
    try:
        cache.tensor.normal_(generator=torch.Generator().manual_seed(0))
        connector.start()
        asyncio.run(serve(conn, setup, connector))
    except Exception as exc:  # a start-up failure: tell the parent rather than leave it waiting
        with contextlib.suppress(OSError):
            conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        connector.close()  # stops the block server, unlinks the cache file


async def serve(conn: Connection, setup: Setup, connector: KVConnector) -> None:
    cache = connector.cache
    senders: dict[str, KVSender] = {}
    if setup.staged:
        senders["staged"] = KVSender(KVSenderConfig(backends=setup.staged, shm_dir=setup.shm_dir),
                                     lambda rid, why: None, tls=setup.tls)
    if setup.core:
        core = CoreCache(connector.cache_file_name, setup.cache_blocks,
                         connector.block_server_address, connector.config.grant_secret,
                         ucx_server=connector.ucx_address)
        senders["core"] = KVSender(KVSenderConfig(backends=setup.core, shm_dir=setup.shm_dir),
                                   lambda rid, why: connector.release(rid), tls=setup.tls,
                                   core=core)
    loop = asyncio.get_running_loop()
    try:
        for sender in senders.values():
            await sender.start()
        conn.send({"ready": True})
        # Streamed exports announced, not sealed yet: the handle, and the blocks reported so far.
        growing: dict[str, tuple[KVHandle, int]] = {}
        # The next request is awaited off the loop: the loop serves the control plane meanwhile.
        while (msg := await loop.run_in_executor(None, receive, conn)) is not None:
            kind, n, rid = msg
            src = block_ids(setup.cache_blocks, n, 1, setup.shuffled)
            layout = KVLayout(LAYERS, n, BLOCK, HEADS, HEAD_DIM, torch.float32, n * BLOCK)
            try:
                if kind == "staged":  # ReadKV's gather, then today's publish
                    kv = cache.index_select(2, torch.tensor(src))
                    conn.send({"handle": senders[kind].publish(rid, kv, n * BLOCK).to_dict()})
                    continue
                if kind == "announce":  # a streamed prompt was scheduled: nothing ready yet
                    connector.open_stream(rid, n * BLOCK)
                    handle = senders["core"].publish_stream(rid, layout, connector.algo)
                    senders["core"].stream_progress(handle, ExportProgress(
                        0, checksum_algo=str(connector.algo)))
                    growing[rid] = (handle, 0)
                    conn.send({"handle": handle.to_dict()})
                    continue
                start = time.perf_counter()
                if kind in ("grow", "seal"):  # a chunk's step ended: checksum, serve, report
                    handle, first = growing.pop(rid)
                    last = n // 2 if kind == "grow" else n  # "grow": the first of two chunks
                    sums = connector.extend_stream(rid, src[first:last])
                    export_s = time.perf_counter() - start
                    if kind == "grow":
                        growing[rid] = (handle, last)
                    senders["core"].stream_progress(handle, ExportProgress(
                        first, src[first:last], sums, str(connector.algo),
                        sealed=kind == "seal"))
                    conn.send({"export_s": export_s})
                    continue
                info = connector.export(rid, src, n * BLOCK)
                export_s = time.perf_counter() - start
                handle = senders[kind].publish_export(rid, layout, src, info.block_checksums,
                                                      parse_algo(info.checksum_algo))
                conn.send({"handle": handle.to_dict(), "export_s": export_s})
            except Exception as exc:  # tell the parent rather than leave it waiting
                conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        for sender in senders.values():
            await sender.stop()


def receive(conn: Connection) -> tuple[str, int, str] | None:
    with contextlib.suppress(EOFError):
        return conn.recv()
    return None  # the parent is gone: stop


@contextlib.contextmanager
def sender_process(setup: Setup) -> Iterator[Connection]:
    """A sender child; yields the pipe that asks it to publish."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=sender_main, args=(child, setup), daemon=True)
    proc.start()
    try:
        ask(parent, None)
        yield parent
    finally:
        with contextlib.suppress(OSError):
            parent.send(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def ask(conn: Connection, request: tuple[str, int, str] | None) -> dict:
    """Send `request` (None: just wait for the child's start) and return the child's answer."""
    if request is not None:
        conn.send(request)
    if not conn.poll(DEADLINE_S):
        raise TimeoutError(f"the sender child did not answer {request} within {DEADLINE_S} s")
    reply = conn.recv()
    if "error" in reply:
        raise RuntimeError(f"sender child: {reply['error']}")
    return reply


async def rounds(one: Callable[[], Awaitable[Timings]], reps: int,
                 budget_s: float) -> list[Timings]:
    await one()  # warm-up: page faults, connections, the peer cache's mapping
    out: list[Timings] = []
    stop = time.monotonic() + budget_s
    while len(out) < reps and (not out or time.monotonic() < stop):
        out.append(await one())
    return out


class Decoder:
    """The decode side, here: its serving process's KVReceiver and its core's cache and
    connector (a shared file too, as a CPU engine allocates it)."""

    def __init__(self, conn: Connection, setup: Setup, rx: KVReceiver) -> None:
        self.conn, self.rx, self.ids = conn, rx, iter(range(1 << 30))
        self.pulls = CorePulls(rx)
        self.cache = shared_zeros(kv_shape(setup.cache_blocks), torch.float32, setup.shm_dir)
        self.cache.tensor.fill_(0.0)  # commit the tmpfs pages: a serving cache is warm
        self.connector = KVConnector(setup.connector_config(tcp=False), self.cache.tensor,
                                     self.cache)

    async def staged(self, backend: str, n: int, dst_ids: list[int]) -> Timings:
        start = time.perf_counter()
        reply = ask(self.conn, ("staged", n, f"s-{next(self.ids)}"))
        kv = await self.rx.fetch(KVHandle.from_dict(reply["handle"]), DEADLINE_S,
                                 backend=backend)
        self.cache.tensor.index_copy_(2, torch.tensor(dst_ids), kv)
        return {"total": time.perf_counter() - start}

    async def core(self, backend: str, n: int, dst_ids: list[int]) -> Timings:
        start = time.perf_counter()
        reply = ask(self.conn, ("core", n, f"c-{next(self.ids)}"))
        handle = KVHandle.from_dict(reply["handle"])
        deadline = Deadline.after(DEADLINE_S)
        pull = await self.pulls.begin(handle, deadline, backend=backend)
        source = KVSource(backend, pull.params, list(handle.block_checksums),
                          str(handle.checksum_algo), handle.layout.num_tokens,
                          (LAYERS, BLOCK, HEADS, HEAD_DIM), "float32",
                          deadline_s=deadline.remaining())
        loading = time.perf_counter()
        try:
            nbytes = self.connector.load(source, 0, dst_ids)
        except BaseException as exc:
            await self.pulls.finish(pull, error=f"{type(exc).__name__}: {exc}")
            raise
        loaded = time.perf_counter()
        # The ack is after the clock, as in an engine (`CorePulls.finish_soon`: a first token
        # does not wait for it), but awaited here so that no round overlaps the next.
        await self.pulls.finish(pull, nbytes=nbytes)
        return {"total": loaded - start, "load": loaded - loading,
                "export": float(reply["export_s"]), "ack": time.perf_counter() - loaded}


    async def streamed(self, backend: str, n: int, dst_ids: list[int],
                       chunks: int = 1) -> Timings:
        """A prompt's handoff on the streamed path, as the engines run it: the export announced
        when its prompt was scheduled, the transfer started and its progress followed while
        the first chunk computes (untimed: here no chunk computes); with two chunks the first
        one's blocks are checksummed, reported and pulled while the second computes (untimed
        too); the clock runs from the end of the last chunk's step (the child told to checksum
        and seal) until the decode core's cache holds every verified block."""
        rid = f"t-{next(self.ids)}"
        handle = KVHandle.from_dict(ask(self.conn, ("announce", n, rid))["handle"])
        deadline = Deadline.after(DEADLINE_S)
        pull = await self.pulls.begin(handle, deadline, backend=backend)
        reports = pull.control.watch(handle, deadline)
        sums: list[int] = []
        src_ids: list[int] = []
        nbytes = 0

        async def pull_next() -> ExportProgress:
            """The next report's blocks pulled into theirs of `dst_ids`, as a pull stream does."""
            nonlocal nbytes
            progress = await anext(reports)
            first = len(sums)
            sums.extend(progress.block_checksums)
            src_ids.extend(progress.block_ids)
            params = dict(pull.params)
            if backend == "shm":  # what the decode core's pull stream does with a report
                params["blocks"] = encode_blocks(src_ids)
            source = KVSource(backend, params, list(sums), progress.checksum_algo, n * BLOCK,
                              (LAYERS, BLOCK, HEADS, HEAD_DIM), "float32",
                              deadline_s=deadline.remaining(), streamed=True)
            nbytes += self.connector.load(source, first, dst_ids[first:len(sums)])
            return progress

        try:
            await anext(reports)  # the announcement: the stream is open
            if chunks == 2:
                self.conn.send(("grow", n, rid))
                await pull_next()
                ask(self.conn, None)
            start = time.perf_counter()
            self.conn.send(("seal", n, rid))
            if not (await pull_next()).sealed:
                raise RuntimeError("the streamed export did not seal")
            loaded = time.perf_counter()
        except BaseException as exc:
            await self.pulls.finish(pull, error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            await reports.aclose()
        await self.pulls.finish(pull, nbytes=nbytes)
        ask(self.conn, None)  # the seal's answer, sent before the blocks moved
        return {"total": loaded - start}


async def measure(conn: Connection, setup: Setup, blocks_list: list[int], reps: int,
                  budget_s: float, suffix: str, exported: set[int]) -> list[dict[str, object]]:
    """Staged and core rounds of every transport and block count."""
    rows: list[dict[str, object]] = []

    def row(path: str, n: int, transport: str, samples: list[Timings], key: str) -> None:
        rows.append({"path": path, "blocks": n, "bytes": n * BLOCK_BYTES,
                     "transport": transport, "rounds": len(samples),
                     "seconds": statistics.median(t[key] for t in samples)})

    async with KVReceiver(KVReceiverConfig(shm_dir=setup.shm_dir), tls=setup.tls) as rx:
        decoder = Decoder(conn, setup, rx)
        try:
            for backend in dict.fromkeys(setup.staged + setup.core):
                name = backend + suffix
                for n in blocks_list:
                    dst_ids = block_ids(setup.cache_blocks, n, 2, setup.shuffled)
                    if backend in setup.staged:
                        samples = await rounds(
                            partial(decoder.staged, backend, n, dst_ids), reps, budget_s)
                        row(f"staged {name}", n, name, samples, "total")
                    if backend in setup.core:
                        samples = await rounds(
                            partial(decoder.core, backend, n, dst_ids), reps, budget_s)
                        row(f"core {name}", n, name, samples, "total")
                        row(f"core {name} (load only)", n, name, samples, "load")
                        row(f"core {name} (ack, after)", n, "", samples, "ack")
                        if n not in exported:  # the same work whatever the transport
                            exported.add(n)
                            row("core export", n, "", samples, "export")
                        samples = await rounds(
                            partial(decoder.streamed, backend, n, dst_ids), reps, budget_s)
                        row(f"core {name} (streamed)", n, name, samples, "total")
                        samples = await rounds(
                            partial(decoder.streamed, backend, n, dst_ids, 2), reps, budget_s)
                        row(f"core {name} (str., 2 chunks)", n, name, samples, "total")
        finally:
            decoder.connector.close()  # unlinks its cache file
    return rows


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (sysfs), 32 MiB where it cannot be read."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = path.read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


async def local_rounds(blocks: int, reps: int, budget_s: float,
                       sweep: torch.Tensor) -> dict[str, float]:
    """copy_ back to back (its bytes stay in the caches: the best case), copy_ of bytes
    evicted first (`sweep` read through, untimed: the state a handoff's bytes are in after
    the milliseconds of control plane around them), and clone."""
    src = torch.randn(kv_shape(blocks))
    dst = torch.empty_like(src)

    async def timed(fn: Callable[[], object], evict: bool = False) -> Timings:
        if evict:
            sweep.sum()
        start = time.perf_counter()
        fn()
        return {"total": time.perf_counter() - start}

    def copy() -> None:
        dst.copy_(src)

    cells = (("copy_", partial(timed, copy)), ("copy_ (cold)", partial(timed, copy, True)),
             ("clone", partial(timed, src.clone)))
    return {name: statistics.median(t["total"] for t in await rounds(one, reps, budget_s))
            for name, one in cells}


def bench_certificates(directory: str) -> TLSConfig:
    """A CA and one service certificate (both ends use it), as the test suite makes them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
    from tests.certs import make_test_certs

    return make_test_certs(Path(directory)).tls


def print_table(rows: list[dict[str, object]], shuffled: bool, cache_blocks: int,
                algo: ChecksumAlgo) -> None:
    print(f"KV handoff, SmolLM2-135M layout ({LAYERS} layers x 2 x {BLOCK} tokens x {HEADS} "
          f"heads x {HEAD_DIM} dims, float32), caches of {cache_blocks} blocks, "
          f"{'shuffled' if shuffled else 'consecutive'} block ids, core block checksums "
          f"{algo}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"| {'path':<26} | {'blocks':>6} | {'MB':>7} | {'ms':>8} | {'GB/s':>6} | "
          f"{'of copy_':>8} | {'of cold copy_':>13} | {'vs staged':>9} |")
    print(f"|{'-' * 28}|{'-' * 7}:|{'-' * 8}:|{'-' * 9}:|{'-' * 7}:|{'-' * 9}:|{'-' * 14}:|"
          f"{'-' * 10}:|")
    for row in rows:
        seconds, nbytes = float(row["seconds"]), int(row["bytes"])
        of_copy = f"{float(row['vs_copy']):.0%}" if "vs_copy" in row else ""
        of_cold = f"{float(row['vs_cold_copy']):.0%}" if "vs_cold_copy" in row else ""
        vs_staged = f"{float(row['vs_staged']):.2f}x" if "vs_staged" in row else ""
        rate = "" if "(ack" in str(row["path"]) else f"{nbytes / seconds / 1e9:.2f}"
        print(f"| {row['path']!s:<26} | {row['blocks']:>6} | {nbytes / 1e6:>7.1f} | "
              f"{seconds * 1e3:>8.2f} | {rate:>6} | {of_copy:>8} | "
              f"{of_cold:>13} | {vs_staged:>9} |")


def as_core_process() -> None:
    """Restart this process with the environment an engine core process starts with (and
    the sender child inherits it), unless it has it already."""
    env = core_environment(os.environ)
    if env != dict(os.environ):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> None:
    as_core_process()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="64,512", help="block counts, e.g. 8,64,512")
    parser.add_argument("--backends", default="shm,tcp",
                        help="staged rows: any KVSender backend; core rows: shm, tcp, "
                             "torch_dist, ucxx")
    parser.add_argument("--ids", choices=("shuffled", "consecutive"), default="shuffled")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads of both processes")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=3.0, help="per table cell")
    parser.add_argument("--checksum", default="default",
                        help="the core rows' block checksum: default (the core's own choice), "
                             "xxh64, xxh3_64, crc32 or lin64")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--tls", choices=("off", "on", "both"), default="both",
                        help="tcp without TLS, with mutual TLS (rows ... tcp+tls), or both")
    args = parser.parse_args()
    blocks_list = [int(b) for b in args.blocks.split(",")]
    backends = tuple(args.backends.split(","))
    cache_blocks, shuffled = max(blocks_list), args.ids == "shuffled"
    algo = (default_block_algo(torch.zeros(kv_shape(1))) if args.checksum == "default"
            else parse_algo(args.checksum))

    torch.set_num_threads(args.threads)
    sweep = torch.ones(3 * last_level_cache_bytes() // 2 // 4)  # 1.5x the largest cache
    local = {n: asyncio.run(local_rounds(n, args.reps, args.budget_s, sweep))
             for n in blocks_list}
    del sweep
    rows: list[dict[str, object]] = [
        {"path": f"local {name}", "blocks": n, "bytes": n * BLOCK_BYTES, "seconds": seconds}
        for n, timings in local.items() for name, seconds in timings.items()]
    with tempfile.TemporaryDirectory(prefix="pdmesh-bench-", dir="/dev/shm") as shm_dir, \
            tempfile.TemporaryDirectory(prefix="pdmesh-bench-certs-") as cert_dir:
        groups: list[tuple[str, tuple[str, ...], TLSConfig | None]] = []
        plain = tuple(b for b in backends if not (b == "tcp" and args.tls == "on"))
        if plain:
            groups.append(("", plain, None))
        if args.tls != "off" and "tcp" in backends:
            groups.append(("+tls", ("tcp",), bench_certificates(cert_dir)))
        exported: set[int] = set()
        for suffix, served, tls in groups:
            setup = Setup(served, tuple(b for b in served if b in WORKER_BACKENDS),
                          cache_blocks, shuffled, shm_dir, tls, args.threads, algo)
            with sender_process(setup) as conn:
                rows += asyncio.run(measure(conn, setup, blocks_list, args.reps,
                                            args.budget_s, suffix, exported))

    staged = {(r["blocks"], r["transport"]): r["seconds"] for r in rows
              if str(r["path"]).startswith("staged ")}
    for row in (r for r in rows if r.get("transport")):
        key, seconds = (row["blocks"], row["transport"]), float(row["seconds"])
        row["vs_copy"] = local[int(row["blocks"])]["copy_"] / seconds
        row["vs_cold_copy"] = local[int(row["blocks"])]["copy_ (cold)"] / seconds
        if key in staged and not str(row["path"]).startswith("staged "):
            row["vs_staged"] = float(staged[key]) / seconds
    rows.sort(key=lambda r: int(r["blocks"]))  # stable: the order measured within a count
    print_table(rows, shuffled, cache_blocks, algo)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
