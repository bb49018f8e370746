"""Where the served path spends its time: every process of `pdmesh serve` under load.

Starts `pdmesh serve` (colocated by default), sends a bounded load through the gateway (48
streamed completions at concurrency 16, random 256-token prompts, 64 tokens out, ignore_eos:
the shape of bench/serving_peer.py's concurrency-16 scenario), and meanwhile, for a fixed
window, records every process of the mesh with py-spy (Python stacks, non-blocking) and reads
its CPU time from /proc. Prints, per process, the CPU it used over the window and the
functions its samples were in (self time), so a regression or a hot spot shows which process
and which module it is in.

    .venv/bin/pip install py-spy                   # once; not a dependency of pdmesh
    python bench/profile_serving.py                 # ~2 min on a quiet machine
    python bench/profile_serving.py --serve-args "--num-prefill 1 --num-decode 1"
    python bench/profile_serving.py --model /tmp/tiny  # a tiny model: the mesh's own cost

With a model whose steps cost next to nothing (a 2-layer, 64-wide random-weight Llama with
SmolLM2's tokenizer: `bench/tiny_model.py`), the serving processes become the bottleneck and
their CPU per streamed token, the column this prints, is what each hop costs by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_peer import ROOT, model_dir, stop, wait_ready

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Proc:
    pid: int
    name: str
    cpu_start: float = 0.0
    cpu_s: float = 0.0
    load_cpu_s: float = 0.0  # over the whole measured load, for the per-token figure
    samples: Counter[str] = field(default_factory=Counter)
    total_samples: int = 0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def name_of(pid: int, parent_names: dict[int, str]) -> str | None:
    """A readable role for a mesh process from its command line; None for what is not ours."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None
    if "pdmesh.engine.core.core_process" in argv:
        return f"engine core of {parent_names.get(ppid, 'a service')}"
    if "pdmesh.cli" in argv:
        role = argv[argv.index("pdmesh.cli") + 1]
        if "--role" in argv:
            role = argv[argv.index("--role") + 1]
        return f"{role} ({pid})" if role in ("prefill", "decode", "colocated") else role
    if argv and argv[0].endswith("pdmesh") and "serve" in argv:
        return "serve (supervisor)"
    if any("redis" in a for a in argv[:1]):
        return "redis"
    return None


def mesh_processes(root: int) -> list[Proc]:
    names: dict[int, str] = {}
    for pid in descendants(root):  # parents come before their children
        name = name_of(pid, names)
        if name is not None:
            names[pid] = name
    return [Proc(pid, name) for pid, name in names.items()]


async def load(base_url: str, requests: int, concurrency: int, vocab: int,
               seed: int) -> tuple[int, float]:
    """Streamed completions; returns (output tokens, seconds)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(100, vocab - 1) for _ in range(256)] for _ in range(requests)]
    gate = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> None:
        nonlocal tokens
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": 64, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        async with gate, client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens += usage["completion_tokens"]

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(one(client, p) for p in prompts))
    return tokens, time.perf_counter() - started


def frame_name(frame: str) -> str:
    """'step (pdmesh/engine/core.py:120)' -> 'step (engine/core/engine_core.py)'."""
    func, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0].rstrip(")")
    for marker in ("site-packages/", "/main/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{func} ({path})"


def read_raw(path: Path) -> tuple[Counter[str], int]:
    """Self samples per function from py-spy's collapsed-stack output."""
    self_time: Counter[str] = Counter()
    total = 0
    if not path.is_file():
        return self_time, 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        self_time[frame_name(frames[-1])] += int(count)
        total += int(count)
    return self_time, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-args", default="--colocated", help="`pdmesh serve` flags")
    parser.add_argument("--model", default=None,
                        help="model alias or HF directory (default: smollm2)")
    parser.add_argument("--port", type=int, default=8012)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--window-s", type=float, default=20.0,
                        help="profile window, started 5 s into the load")
    parser.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--idle", action="store_true",
                        help="count idle threads' samples too (where a process waits)")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy", path=str(ROOT / ".venv/bin")) or shutil.which("py-spy")
    if py_spy is None:
        sys.exit("py-spy not found: .venv/bin/pip install py-spy")
    model = args.model or model_dir()
    argv = [str(ROOT / ".venv/bin/pdmesh"), "serve", model, "--port", str(args.port),
            "--served-model-name", "smollm2", *shlex.split(args.serve_args)]
    out_dir = Path(tempfile.mkdtemp(prefix="pdmesh-profile-"))
    log = out_dir / "serve.log"
    with log.open("wb") as fh:
        server = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT,
                                  start_new_session=True, cwd=ROOT)
        try:
            wait_ready(args.port, server, timeout_s=600)
            procs = mesh_processes(server.pid)
            base_url = f"http://127.0.0.1:{args.port}"
            vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
            asyncio.run(load(base_url, 4, 4, vocab, seed=1))  # warm-up
            result = run_profiled(args, py_spy, procs, base_url, out_dir, vocab)
        finally:
            stop(server)
    tokens, elapsed = result
    print(f"\n`pdmesh serve {args.serve_args}`: {args.requests} streamed requests at "
          f"concurrency {args.concurrency}, 256 in / 64 out: {tokens} tokens in {elapsed:.1f} s "
          f"= {tokens / elapsed:.1f} out tok/s; profile window {args.window_s:.0f} s\n")
    print("| process | CPU s / window s | CPU ms / out token | py-spy samples "
          "| top functions (self time) |")
    print("|---|---|---|---|---|")
    for p in sorted(procs, key=lambda p: -p.cpu_s):
        top = ", ".join(f"{name} {count / p.total_samples:.0%}"
                        for name, count in p.samples.most_common(args.top)) or "-"
        per_token = p.load_cpu_s / max(tokens, 1) * 1e3
        print(f"| {p.name} | {p.cpu_s / args.window_s:.2f} | {per_token:.3f} "
              f"| {p.total_samples} | {top} |")
    print(f"\nraw stacks: {out_dir}")


def run_profiled(args: argparse.Namespace, py_spy: str, procs: list[Proc], base_url: str,
                 out_dir: Path, vocab: int) -> tuple[int, float]:
    async def go() -> tuple[int, float]:
        at_start = {p.pid: cpu_seconds(p.pid) for p in procs}
        task = asyncio.ensure_future(load(base_url, args.requests, args.concurrency, vocab, 7))
        await asyncio.sleep(5.0)
        spies = []
        for p in procs:
            p.cpu_start = cpu_seconds(p.pid)
            spies.append(subprocess.Popen(
                [py_spy, "record", "--pid", str(p.pid), "--rate", str(args.rate),
                 "--duration", str(int(args.window_s)), "--nonblocking", "--threads",
                 "--format", "raw", "-o", str(out_dir / f"{p.pid}.txt"),
                 *(["--idle"] if args.idle else [])],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        await asyncio.sleep(args.window_s)
        for p in procs:
            p.cpu_s = cpu_seconds(p.pid) - p.cpu_start
        for spy in spies:
            await asyncio.to_thread(spy.wait, 60)
        done = await task
        for p in procs:
            p.load_cpu_s = cpu_seconds(p.pid) - at_start[p.pid]
        return done

    tokens, elapsed = asyncio.run(go())
    for p in procs:
        p.samples, p.total_samples = read_raw(out_dir / f"{p.pid}.txt")
    return tokens, elapsed


if __name__ == "__main__":
    main()
