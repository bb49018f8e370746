"""Requests under failure: 1 prefill + 2 decode under steady load while decodes die or hang.

Runs one deterministic workload twice, each time on a fresh local mesh (`LocalMesh`: real
processes, a real redis-server, KV moving prefill -> decode): first undisturbed, then with a
fault every `--kill-every-s` seconds, the decode instances taking turns:

* `--mode kill` (default): the decode is SIGKILLed and started again at once (a kill waits
  until the other decode is serving again, so one decode is always meant to be up);
* `--mode freeze`: the decode is stopped (SIGSTOP) for `--freeze-s` seconds, then continued
  (SIGCONT) — its engine core only (`--freeze-target core`, the service keeps answering) or the
  whole service with its core (`service`). The router's progress watchdog should move its
  streams after the stall bound (a few seconds) instead of letting them wait out the freeze.

Requests are greedy streams through the router's gRPC API, sent on a fixed schedule (`--rate`
per second for `--duration-s`).

Prints, per run: requests ok / failed (an RPC error or an error finish), the share of streams
whose tokens equal the undisturbed run's, faults made, and end-to-end latency p50/p99.
Target (issue 10): 0 failed, 100 % token-exact; frozen: p99 about the undisturbed run's plus
the stall bound, not plus `--freeze-s`.

    .venv/bin/python bench/chaos.py [--duration-s 90] [--rate 1] [--kill-every-s 20]
    .venv/bin/python bench/chaos.py --mode freeze [--freeze-s 20] [--freeze-target core]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import grpc

from pdmesh.serve import Child, LocalMesh, MeshConfig, pdmesh_command
from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

TOPICS = ["a lighthouse", "a chess game", "bread", "a comet", "rain in a city", "a robot",
          "the ocean floor", "a mountain village", "an old library", "a night train"]


@dataclass
class Result:
    index: int
    ok: bool
    token_ids: list[int]
    latency_s: float
    error: str = ""


@dataclass
class Run:
    label: str
    results: list[Result] = field(default_factory=list)
    faults: int = 0  # kills or freezes made
    restart_s: list[float] = field(default_factory=list)


def prompt(index: int) -> str:
    return (f"Request {index}. Write three sentences about {TOPICS[index % len(TOPICS)]}, "
            f"then list {index % 5 + 2} related words.")


def one_request(address: str, index: int, max_tokens: int, timeout_s: float) -> Result:
    request = router_pb2.GenerateRequest(
        request_id=f"chaos-{index}-{time.monotonic_ns()}",
        text=prompt(index),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True),
        stream=True,
    )
    started = time.monotonic()
    tokens: list[int] = []
    try:
        with grpc.insecure_channel(address) as channel:
            for resp in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=timeout_s):
                if not resp.HasField("delta"):
                    continue
                tokens += resp.delta.token_ids
                finish = resp.delta.finish if resp.delta.HasField("finish") else None
                if finish is not None and finish.reason == common_pb2.FINISH_REASON_ERROR:
                    return Result(index, False, tokens, time.monotonic() - started,
                                  f"error finish: {finish.message}")
    except grpc.RpcError as exc:
        return Result(index, False, tokens, time.monotonic() - started,
                      f"{exc.code().name}: {exc.details()}")
    return Result(index, True, tokens, time.monotonic() - started)


def chaos(mesh: LocalMesh, run: Run, every_s: float, stop: threading.Event,
          startup_timeout_s: float) -> None:
    """Kill decode i, start a replacement at once; take turns; one decode is always meant up."""
    victim = 0
    next_kill = time.monotonic() + every_s
    while not stop.wait(max(0.0, next_kill - time.monotonic())):
        old = mesh.decode[victim]
        old.kill()
        run.faults += 1
        started = time.monotonic()
        fresh = Child(f"decode-{victim}-r{run.faults}",
                      pdmesh_command("decode", *mesh.engine_args("decode")))
        mesh.decode[victim] = fresh  # LocalMesh.stop() stops the replacement
        fresh.wait_ready(startup_timeout_s)
        run.restart_s.append(time.monotonic() - started)
        victim = 1 - victim
        next_kill = max(next_kill + every_s, time.monotonic())


def freezes(mesh: LocalMesh, run: Run, every_s: float, stop: threading.Event, freeze_s: float,
            target: str) -> None:
    """Stop decode i (its core, or service and core) for `freeze_s`, then continue it; take
    turns. Whatever happens, nothing is left stopped."""
    victim = 0
    next_freeze = time.monotonic() + every_s
    while not stop.wait(max(0.0, next_freeze - time.monotonic())):
        child = mesh.decode[victim]
        core = int(child.fields["core_pid"])
        pids = [core] if target == "core" else [child.pid, core]
        try:
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            run.faults += 1
            stop.wait(freeze_s)
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        victim = 1 - victim
        next_freeze = max(next_freeze + every_s, time.monotonic())


def run_once(label: str, args: argparse.Namespace, faults: bool) -> Run:
    run = Run(label)
    config = MeshConfig(num_prefill=1, num_decode=2, kv_cache_memory=args.kv_cache_memory,
                        local_prefill_threshold=0, gateway_port=-1)
    with LocalMesh(config) as mesh:
        address = mesh.router_address
        one_request(address, 10_000, 4, 120)  # warm-up outside the measurement
        stop = threading.Event()
        killer = None
        if faults and args.mode == "freeze":
            killer = threading.Thread(
                target=freezes, args=(mesh, run, args.kill_every_s, stop, args.freeze_s,
                                      args.freeze_target), daemon=True)
            killer.start()
        elif faults:
            killer = threading.Thread(
                target=chaos, args=(mesh, run, args.kill_every_s, stop, 180.0), daemon=True)
            killer.start()
        count = int(args.duration_s * args.rate)
        t0 = time.monotonic()
        futures: list[Future[Result]] = []
        try:
            with ThreadPoolExecutor(max_workers=args.max_concurrency) as pool:
                for i in range(count):
                    time.sleep(max(0.0, t0 + i / args.rate - time.monotonic()))
                    futures.append(pool.submit(one_request, address, i, args.max_tokens,
                                               args.timeout_s))
                run.results = [f.result() for f in futures]
        finally:
            stop.set()  # a freeze in progress ends now: nothing is left stopped
            if killer is not None:
                killer.join(timeout=200)
    return run


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summary(run: Run, reference: dict[int, list[int]] | None) -> dict[str, object]:
    """One table row; `reference` None marks the run the others are compared with."""
    ok = [r for r in run.results if r.ok]
    exact = sum(1 for r in ok if reference is not None and r.token_ids == reference.get(r.index))
    latencies = [r.latency_s * 1e3 for r in ok] or [float("nan")]
    return {
        "run": run.label,
        "requests": len(run.results),
        "ok": len(ok),
        "failed": len(run.results) - len(ok),
        "token_exact": ("reference" if reference is None
                        else f"{exact / max(1, len(run.results)):.1%}"),
        "faults": run.faults,
        "restart_s_p50": round(statistics.median(run.restart_s), 1) if run.restart_s else None,
        "e2e_p50_ms": round(statistics.median(latencies)),
        "e2e_p99_ms": round(percentile(latencies, 99)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=90.0)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
    parser.add_argument("--mode", choices=("kill", "freeze"), default="kill",
                        help="kill: SIGKILL and restart a decode; freeze: SIGSTOP, then SIGCONT")
    parser.add_argument("--kill-every-s", type=float, default=20.0,
                        help="seconds between faults (kills or freezes)")
    parser.add_argument("--freeze-s", type=float, default=20.0,
                        help="freeze mode: how long a decode stays stopped")
    parser.add_argument("--freeze-target", choices=("core", "service"), default="core",
                        help="freeze mode: stop the engine core only, or service and core")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--timeout-s", type=float, default=180.0, help="per-request deadline")
    parser.add_argument("--kv-cache-memory", default="128MiB")
    parser.add_argument("--json", action="store_true", help="also print JSON rows")
    args = parser.parse_args(argv)

    baseline = run_once("no faults", args, faults=False)
    reference = {r.index: r.token_ids for r in baseline.results if r.ok}
    frozen = args.mode == "freeze"
    faulty = run_once(f"decode {args.freeze_target} frozen" if frozen else "decode killed",
                      args, faults=True)
    rows = [summary(baseline, None), summary(faulty, reference)]

    fault = (f"a decode's {args.freeze_target} SIGSTOPped for {args.freeze_s:g} s"
             if frozen else "a decode SIGKILLed and restarted")
    print(f"1 prefill + 2 decode, {args.rate:g} req/s for {args.duration_s:g} s, "
          f"{args.max_tokens} greedy tokens each; {fault} every {args.kill_every_s:g} s in "
          f"the second run")
    headers = list(rows[0])
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in headers]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for row in rows:
        print("  ".join(str(row[h]).rjust(w) for h, w in zip(headers, widths, strict=True)))
    failures = [r for r in faulty.results if not r.ok][:5]
    for r in failures:
        print(f"  failed #{r.index} after {len(r.token_ids)} tokens: {r.error[:160]}")
    if args.json:
        print(json.dumps({"args": vars(args), "rows": rows,
                          "failures": [asdict(r) for r in failures]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
