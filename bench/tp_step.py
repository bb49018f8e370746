"""Tensor parallelism on one CPU host: TP=2 against TP=1 at the same total threads, and the
share of rank 0's step spent in collectives.

One offline workload (`--prompts` prompts of `--prompt-len` random token ids, seeded, greedy,
ignore_eos, `--output-len` tokens each) through `LLM.generate` at each `--sizes` entry, with
the same `--threads` in total: TP=1 runs them all in one engine, TP=N splits them over its
ranks as the engine does (engine/core/ranks.py `rank_config`: threads // N per rank). Runs are
interleaved in one sitting (1, 2, 1, 2, ... for `--rounds` rounds), each on a freshly built and
warmed engine, so drift of a shared machine shows in both. Per run: output tokens/s; rank 0's
mean step time (the engine core's `step`: schedule, send the inputs, model, sample, commit)
for decode-only steps and for steps with prompt tokens; and the share of those steps spent in
collectives (the step inputs' broadcast, the all-reduces after o_proj/down_proj and the
embedding, the logits' gather), timed on rank 0 from launch to completion, so waiting for a
slower rank counts (engine/worker/parallel/group.py `record_collectives`; off outside this
bench). The process restarts itself once with the environment a core process gets
(engine/worker/cpu_threads.py: GOMP_SPINCOUNT=10000), which the ranks get too.

    .venv/bin/python bench/tp_step.py                       # ~2-4 min on a 2-core machine
    .venv/bin/python bench/tp_step.py --quick               # a smoke run, ~15 s
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdmesh import LLM, SamplingParams
from pdmesh.engine.worker.cpu_threads import core_environment, rank_threads, usable_cpus
from pdmesh.engine.worker.parallel.group import CollectiveTimes, record_collectives

KINDS = ("decode", "prefill")
COLLECTIVES = ("all_reduce", "gather", "broadcast")


@dataclass
class StepStats:
    """Rank 0's steps of one kind: how many, their wall time, the collectives' part of it."""

    steps: int = 0
    seconds: float = 0.0
    collective: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0.0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0))

    def mean_ms(self) -> float | None:
        return 1000 * self.seconds / self.steps if self.steps else None

    def share(self) -> float | None:
        return sum(self.collective.values()) / self.seconds if self.seconds else None


@dataclass
class Run:
    size: int
    threads_per_rank: int
    wall_s: float
    output_tokens: int
    outputs: list[list[int]]
    by_kind: dict[str, StepStats]

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def as_core_process() -> None:
    """Restart this process with the environment an engine core process starts with (its
    ranks get it too), unless it has it already."""
    env = core_environment(os.environ)
    if env != dict(os.environ):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def instrument(llm: LLM, times: CollectiveTimes) -> dict[str, StepStats]:
    """Time every step of rank 0 (the engine core in this process) that ran the model, by
    kind (any prompt token: prefill), with the collectives' seconds it spent inside."""
    core = llm.engine.core
    runner = core.runner
    by_kind = {k: StepStats() for k in KINDS}
    kind: list[str | None] = [None]
    prepare = runner.prepare

    def classify(scheduled: Any, pending: Any = None) -> Any:
        kind[0] = "decode" if all(s.num_new_tokens == 1 for s in scheduled) else "prefill"
        return prepare(scheduled, pending)

    step = core.step

    def timed_step() -> Any:
        kind[0] = None
        seconds = dict(times.seconds)
        calls = dict(times.calls)
        started = time.perf_counter()
        out = step()
        elapsed = time.perf_counter() - started
        if kind[0] is not None:  # an empty schedule runs no model: not a step here
            stats = by_kind[kind[0]]
            stats.steps += 1
            stats.seconds += elapsed
            for c in COLLECTIVES:
                stats.collective[c] += times.seconds.get(c, 0.0) - seconds.get(c, 0.0)
                stats.calls[c] += times.calls.get(c, 0) - calls.get(c, 0)
        return out

    runner.prepare = classify
    core.step = timed_step
    return by_kind


def run_once(args: argparse.Namespace, size: int, prompts: list[dict[str, list[int]]],
             warm: list[dict[str, list[int]]]) -> Run:
    llm = LLM(args.model, tensor_parallel_size=size, cpu_threads=args.threads,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_memory)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        warm_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        llm.generate(warm, warm_params, use_tqdm=False)  # kernels built, the ranks' first step
        times = CollectiveTimes()
        by_kind = instrument(llm, times)
        record_collectives(times)
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
    finally:
        record_collectives(None)
        llm.engine.core.close()  # stops the ranks
    ids = [list(o.outputs[0].token_ids) for o in outs]
    produced = sum(len(t) for t in ids)
    assert produced == len(prompts) * args.output_len, "ignore_eos: every prompt runs to the end"
    per_rank = rank_threads(args.threads, "cpu", args.threads, size) or args.threads
    del llm
    gc.collect()
    return Run(size, per_rank, wall, produced, ids, by_kind)


# -- provenance and output --------------------------------------------------------------------


def git_revision() -> str:
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], capture_output=True, text=True, timeout=10,
                              check=True, cwd=os.path.dirname(os.path.abspath(__file__))
                              ).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def memory_gib() -> str:
    try:
        return f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError):
        return "? GiB"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def provenance(args: argparse.Namespace) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    spin = (f"GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']}" if os.environ.get("GOMP_SPINCOUNT")
            else f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    return (f"{when}, commit {git_revision()}, {platform.node()}: {cpu_model()} "
            f"({platform.machine()}), {usable_cpus()} usable CPUs, {memory_gib()}; "
            f"torch {torch.__version__}, python {platform.python_version()}, "
            f"{args.threads} threads in total per engine, {spin}\n"
            f"workload: {args.prompts} prompts x {args.prompt_len} random ids (seed {args.seed}), "
            f"{args.output_len} tokens out each (greedy, ignore_eos), max_num_seqs "
            f"{args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
            f"kv_cache_memory {args.kv_cache_memory} per rank, model {args.model}")


def cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def percent(share: float | None, size: int) -> str:
    """A collectives' share as a table cell; a single rank has no collectives."""
    return cell(100 * share if share is not None and size > 1 else None, ".1f")


def print_runs(runs: list[Run]) -> None:
    print("\n| run | TP | threads/rank | wall s | out tok/s | decode step ms (n) | "
          "prefill step ms (n) | collectives % decode | collectives % prefill |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(runs, 1):
        d, p = r.by_kind["decode"], r.by_kind["prefill"]
        print(f"| {i} | {r.size} | {r.threads_per_rank} | {r.wall_s:.1f} | {r.tok_per_s:.1f} | "
              f"{cell(d.mean_ms(), '.1f')} ({d.steps}) | {cell(p.mean_ms(), '.1f')} ({p.steps}) "
              f"| {percent(d.share(), r.size)} | {percent(p.share(), r.size)} |")


def print_summary(runs: list[Run], sizes: list[int]) -> None:
    """Per size: the mean over its runs, and where its collective time went."""
    def mean(values: list[float | None]) -> float | None:
        got = [v for v in values if v is not None]
        return statistics.fmean(got) if got else None

    print("\n| TP | runs | out tok/s | vs TP=1 | decode step ms | prefill step ms | "
          "collectives % decode | collectives % prefill |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = mean([r.tok_per_s for r in runs if r.size == 1])
    for size in sizes:
        mine = [r for r in runs if r.size == size]
        tps = mean([r.tok_per_s for r in mine])
        ratio = f"{tps / base:.2f}x" if base and tps else "-"
        step_ms = [cell(mean([r.by_kind[k].mean_ms() for r in mine]), ".1f") for k in KINDS]
        shares = [percent(mean([r.by_kind[k].share() for r in mine]), size) for k in KINDS]
        print(f"| {size} | {len(mine)} | {cell(tps, '.1f')} | {ratio} | {step_ms[0]} | "
              f"{step_ms[1]} | {shares[0]} | {shares[1]} |")
    for size in (s for s in sizes if s > 1):
        mine = [r for r in runs if r.size == size]
        print(f"\nTP={size}, rank 0's collectives per step (all its runs):")
        print("| collective | decode: ms/step | calls/step | prefill: ms/step | calls/step |")
        print("|---|---:|---:|---:|---:|")
        for c in COLLECTIVES:
            cells = []
            for k in KINDS:
                steps = sum(r.by_kind[k].steps for r in mine)
                secs = sum(r.by_kind[k].collective[c] for r in mine)
                calls = sum(r.by_kind[k].calls[c] for r in mine)
                cells += ([f"{1000 * secs / steps:.2f}", f"{calls / steps:.1f}"] if steps
                          else ["-", "-"])
            print(f"| {c} | {' | '.join(cells)} |")


def same_outputs(runs: list[Run]) -> str:
    first = runs[0].outputs
    differ = [(i, r.size) for i, r in enumerate(runs, 1) if r.outputs != first]
    if not differ:
        return "every run produced the same tokens (greedy)"
    return ("runs whose tokens differ from run 1's (a near-tie broken otherwise by another "
            f"reduction order): {differ}")


def main() -> None:
    as_core_process()
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, in each round's order")
    ap.add_argument("--threads", type=int, default=usable_cpus(),
                    help="CPU threads of each engine in total, split over its ranks")
    ap.add_argument("--rounds", type=int, default=3, help="each size runs once per round")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512,
                    help="below prompts x prompt-len, so prompts take several steps")
    ap.add_argument("--kv-cache-memory", default="512MiB", help="KV budget of each rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="one round of 2 prompts x 32 ids, 8 tokens out, 32-token steps")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.prompts, args.prompt_len, args.output_len = 1, 2, 32, 8
        args.max_num_batched_tokens = 32
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(s < 1 or s > args.threads for s in sizes) or args.rounds < 1:
        ap.error("each size needs 1..--threads ranks (a thread each), and --rounds >= 1")

    rng = random.Random(args.seed)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.prompt_len)]}
               for _ in range(args.prompts)]
    warm = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(32)]}
            for _ in range(2)]
    print(provenance(args))
    print(f"load average at start: {load()}", flush=True)
    runs: list[Run] = []
    started = time.perf_counter()
    for round_ in range(args.rounds):
        for size in sizes:
            run = run_once(args, size, prompts, warm)
            runs.append(run)
            print(f"round {round_ + 1}, TP={size}: {run.wall_s:.1f} s, {run.tok_per_s:.1f} "
                  f"out tok/s (load {load()})", file=sys.stderr, flush=True)
    print(f"load average at end: {load()}; {time.perf_counter() - started:.0f} s in all, "
          "engine builds included")
    print(same_outputs(runs))
    print_runs(runs)
    print_summary(runs, sizes)


if __name__ == "__main__":
    main()
