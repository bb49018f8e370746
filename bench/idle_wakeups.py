"""What an idle mesh costs the CPUs: per process of `pdmesh serve`, CPU share and wake-ups.

An engine core's step runs on OpenMP threads that meet at a barrier after every parallel region;
on a host with as many CPUs as threads, any other thread that wakes takes a CPU from one of
them and the whole region waits for it. So the wake-ups of the processes beside the core cost
the model more than their CPU time says: ucxx's default progress thread, waking ~900 times a
second in an idle core, cost a served mesh on 2 CPUs 12-25 % of its throughput; a CPU host's
cores no longer start it under `--kv-backend auto` (bench/README.md, "An idle UCX
listener"). This starts a mesh, lets it settle, and for `--seconds` reads each process's CPU
time and each thread's voluntary context switches from /proc (Linux).

    .venv/bin/python bench/idle_wakeups.py [--args="--colocated"] [--seconds 10] [--env K=V]
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from profile_serving import cpu_seconds, mesh_processes
from serving_peer import ROOT, wait_ready


@dataclass(frozen=True)
class Sample:
    cpu_s: float
    switches: dict[int, tuple[str, int]]  # tid -> (thread name, voluntary context switches)


def _sample(pid: int) -> Sample | None:
    try:
        switches = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
            switches[int(tid)] = (fields["Name"].strip(),
                                  int(fields["voluntary_ctxt_switches"]))
        return Sample(cpu_seconds(pid), switches)
    except (OSError, KeyError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--args", default="--colocated", help="`pdmesh serve` flags")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--port", type=int, default=8013)
    parser.add_argument("--settle-s", type=float, default=8.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--thread-min", type=float, default=5.0,
                        help="list threads waking at least this often (per second)")
    args = parser.parse_args()
    env = {**os.environ, **dict(kv.split("=", 1) for kv in args.env)}
    argv = [str(ROOT / ".venv/bin/pdmesh"), "serve", args.model, "--port", str(args.port),
            *shlex.split(args.args)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=env)
    try:
        wait_ready(args.port, proc, timeout_s=600)
        time.sleep(args.settle_s)  # start-up work (warm-ups, first heartbeats) is not idling
        names = {p.pid: p.name for p in mesh_processes(proc.pid)}
        pids = list(names)
        before = {pid: _sample(pid) for pid in pids}
        started = time.monotonic()
        time.sleep(args.seconds)
        after = {pid: _sample(pid) for pid in pids}
        elapsed = time.monotonic() - started
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
    print(f"pdmesh serve {args.model} {args.args}; idle for {elapsed:.1f} s\n")
    print("| process | CPU % | wake-ups/s | busiest threads (wake-ups/s) |")
    print("|---|---:|---:|---|")
    total_cpu = total_wakes = 0.0
    for pid in pids:
        a, b = before.get(pid), after.get(pid)
        if a is None or b is None:
            continue
        rates = {tid: (name, (n - a.switches[tid][1]) / elapsed)
                 for tid, (name, n) in b.switches.items() if tid in a.switches}
        wakes = sum(rate for _, rate in rates.values())
        cpu = (b.cpu_s - a.cpu_s) / elapsed * 100
        total_cpu, total_wakes = total_cpu + cpu, total_wakes + wakes
        busy = sorted(rates.values(), key=lambda r: -r[1])
        shown = ", ".join(f"{name} {rate:.0f}" for name, rate in busy if rate >= args.thread_min)
        print(f"| {names[pid]} | {cpu:.1f} | {wakes:.0f} | {shown} |")
    print(f"| **all** | {total_cpu:.1f} | {total_wakes:.0f} | |")


if __name__ == "__main__":
    sys.exit(main())
