"""Served throughput and latency: `pdmesh serve` against the real vLLM CPU build, one sitting.

Both servers are judged by vLLM's own `bench serve` client with ../shared/peer/bench-serve.sh's
settings (random dataset, 256 tokens in / 64 out, ignore_eos; Poisson 1 req/s with 40 prompts,
and concurrency 16 with 48 prompts), started one after the other and never at once,
interleaved A B A B ... so that drift of this noisy 2-core machine hits both alike. The table
shows each run and the median per server: throughput, TTFT, TPOT, ITL p99 (over every gap
between two chunks of every request), the share of gaps over 200 ms and the longest gap (what
p99 cannot show: how many stalls hide in its top 1 % and how long they are), and goodput
(requests/s whose TTFT <= 2 s and whose every gap <= 200 ms: a stream the reader never saw
freeze; computed from the client's per-request data, which vLLM's own goodput, by TPOT,
cannot see). Then the offline ceiling: `LLM.generate` on same-shaped requests (48 random
256-token prompts, 64 tokens out, max_num_seqs=16), which served throughput is compared with.

    bash ../shared/peer/setup-vllm-cpu.sh          # once
    python bench/serving_peer.py --runs 3           # ~25 min on a quiet machine
    python bench/serving_peer.py --runs 1 --skip-vllm --pdmesh-args "--colocated"
    # the ITL target against no target, each run, beside vllm-cpu:
    python bench/serving_peer.py --runs 3 --baseline-args "--colocated --itl-target-ms 0" \
        --baseline-each-run --skip-offline
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT.parent / "shared" / "peer"
RESULTS = Path.home() / ".cache" / "pdmesh-peer" / "results"


GOODPUT_TTFT_S = 2.0
GOODPUT_ITL_S = 0.2


@dataclass
class Run:
    server: str
    scenario: str
    out_tok_s: float
    tpot_p50: float
    tpot_p99: float
    ttft_p50: float
    completed: int
    itl_p99: float = 0.0
    goodput: float = 0.0  # req/s with TTFT <= 2 s and every gap <= 200 ms
    slow_gaps: float = 0.0  # share of all gaps > 200 ms: how much of the tail p99 hides
    itl_max: float = 0.0  # ms: the longest freeze any reader saw


def goodput_of(result: dict) -> float:
    """Requests per second whose TTFT and every inter-chunk gap met the SLOs (the client's
    --save-detailed lists)."""
    ttfts, itls = result.get("ttfts") or [], result.get("itls") or []
    met = sum(1 for ttft, gaps in zip(ttfts, itls, strict=False)
              if ttft is not None and 0 < ttft <= GOODPUT_TTFT_S
              and max(gaps, default=0.0) <= GOODPUT_ITL_S)
    duration = result.get("duration") or 0.0
    return met / duration if duration else 0.0


def gap_tail(result: dict) -> tuple[float, float]:
    """The share of all inter-chunk gaps over 200 ms, and the longest gap in ms. ITL p99 only
    says where the slowest 1 % of gaps begins: a server whose stalls fit in that 1 % shows a
    low p99 however long they are."""
    gaps = [g for request in result.get("itls") or [] for g in request]
    if not gaps:
        return 0.0, 0.0
    return sum(g > GOODPUT_ITL_S for g in gaps) / len(gaps), 1e3 * max(gaps)


def bench_client(port: int, label: str, model: str) -> None:
    """vLLM's `bench serve` client, with bench-serve.sh's two scenarios and per-request data."""
    venv = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache/pdmesh-peer/vllm"))
    common = ["--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--endpoint",
              "/v1/completions", "--model", "smollm2", "--tokenizer", model, "--dataset-name",
              "random", "--random-input-len", "256", "--random-output-len", "64",
              "--ignore-eos", "--seed", "7", "--percentile-metrics", "ttft,tpot,itl,e2el",
              "--metric-percentiles", "50,90,99", "--save-result", "--save-detailed",
              "--result-dir", str(RESULTS)]
    code = ("import sys\nfrom vllm.utils.argparse_utils import FlexibleArgumentParser\n"
            "from vllm.benchmarks.serve import add_cli_args, main\n"
            "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
    for scenario, extra in (("rate1", ["--num-prompts", "40", "--request-rate", "1.0"]),
                            ("conc16", ["--num-prompts", "48", "--request-rate", "inf",
                                        "--max-concurrency", "16"])):
        with (RESULTS / f"{label}-{scenario}.log").open("wb") as log:
            subprocess.run([str(venv / "bin/python"), "-c", code, *common, *extra,
                            "--result-filename", f"{label}-{scenario}.json"],
                           check=False, stdout=log, stderr=subprocess.STDOUT, timeout=1800)


def model_dir() -> str:
    out = subprocess.run([str(ROOT / ".venv/bin/pdmesh"), "model", "path", "smollm2"],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server on {port} not ready after {timeout_s:.0f}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def serve_and_bench(label: str, argv: list[str], port: int, model: str,
                    log: Path, env: dict[str, str] | None = None) -> list[Run]:
    with log.open("wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=ROOT,
                                env=None if env is None else {**os.environ, **env})
        try:
            wait_ready(port, proc, timeout_s=600)
            bench_client(port, label, model)
        finally:
            stop(proc)
    runs = []
    for scenario in ("rate1", "conc16"):
        path = RESULTS / f"{label}-{scenario}.json"
        if not path.is_file():
            raise RuntimeError(f"{label}: no {scenario} result (see {log})")
        r = json.loads(path.read_text())
        path.unlink()
        runs.append(Run(label.split("#")[0], scenario, r.get("output_throughput", 0.0),
                        r.get("median_tpot_ms", 0.0), r.get("p99_tpot_ms", 0.0),
                        r.get("median_ttft_ms", 0.0), int(r.get("completed", 0)),
                        r.get("p99_itl_ms", 0.0), goodput_of(r), *gap_tail(r)))
    return runs


def offline_ceiling(model: str, max_num_seqs: int) -> float:
    """Output tok/s of `LLM.generate` on the bench client's shapes (same engine, no serving),
    sampling as the served requests do: the client sends no sampling fields, so the server
    applies the model's generation config (SmolLM2: temperature 0.2, top-p 0.9)."""
    from pdmesh import LLM

    llm = LLM(model, max_num_seqs=max_num_seqs, max_model_len=2048)
    rng = random.Random(7)
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randint(100, vocab - 1) for _ in range(256)]}
               for _ in range(48)]
    params = replace(llm.get_default_sampling_params(), max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="A B pairs")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--pdmesh-args", default="--colocated",
                        help="extra `pdmesh serve` flags")
    parser.add_argument("--vllm-args", default="",
                        help="extra vLLM server flags (after the peer script's own: e.g. "
                             "'--dtype bfloat16' overrides its float32)")
    parser.add_argument("--baseline-args", default="",
                        help="also run pdmesh once with these flags instead (e.g. "
                             "'--colocated --no-engine-core-process'), labelled pdmesh-baseline")
    parser.add_argument("--baseline-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment of the pdmesh-baseline run (repeatable), e.g. "
                             "PDMESH_CPU_KERNELS=0")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=ARGS",
                        help="also run pdmesh with these `pdmesh serve` flags in every round, "
                             "labelled LABEL (repeatable)")
    parser.add_argument("--baseline-each-run", action="store_true",
                        help="run the baseline in every round (A B C A B C ...), not once")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-offline", action="store_true")
    args = parser.parse_args()
    model = model_dir()
    RESULTS.mkdir(parents=True, exist_ok=True)
    vllm_argv = ["bash", str(PEER / "vllm-cpu-serve.sh"), model, str(args.port),
                 *shlex.split(args.vllm_args)]
    pdmesh_argv = [str(ROOT / ".venv/bin/pdmesh"), "serve", model, "--port", str(args.port),
                   "--served-model-name", "smollm2", *shlex.split(args.pdmesh_args)]
    runs: list[Run] = []
    baseline = bool(args.baseline_args or args.baseline_env)
    base_argv = [*pdmesh_argv[:7], *shlex.split(args.baseline_args or args.pdmesh_args)]
    base_env = dict(kv.split("=", 1) for kv in args.baseline_env)
    for i in range(args.runs):
        if not args.skip_vllm:
            runs += serve_and_bench(f"vllm-cpu#{i}", vllm_argv, args.port, model,
                                    Path(f"/tmp/serving-peer-vllm-{i}.log"))
        runs += serve_and_bench(f"pdmesh#{i}", pdmesh_argv, args.port, model,
                                Path(f"/tmp/serving-peer-pdmesh-{i}.log"))
        for variant in args.variant:
            label, _, flags = variant.partition("=")
            runs += serve_and_bench(f"{label}#{i}", [*pdmesh_argv[:7], *shlex.split(flags)],
                                    args.port, model, Path(f"/tmp/serving-peer-{label}-{i}.log"))
        if baseline and (args.baseline_each_run or i == 0):
            runs += serve_and_bench(f"pdmesh-baseline#{i}", base_argv, args.port, model,
                                    Path(f"/tmp/serving-peer-baseline-{i}.log"), env=base_env)
        print(f"round {i + 1}/{args.runs} done", file=sys.stderr, flush=True)

    print(f"\npdmesh serve {args.pdmesh_args}; vllm-cpu {args.vllm_args or '(the peer script)'}; "
          "vLLM `bench serve`, 256 in / 64 out, ignore_eos\n")
    print("| server | scenario | run | out tok/s | TTFT p50 ms | TPOT p50 ms | TPOT p99 ms | "
          "ITL p99 ms | gaps > 200 ms | ITL max ms | goodput req/s | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    counters: dict[tuple[str, str], int] = {}
    for r in runs:
        k = counters[(r.server, r.scenario)] = counters.get((r.server, r.scenario), 0) + 1
        print(f"| {r.server} | {r.scenario} | {k} | {r.out_tok_s:.1f} | {r.ttft_p50:.0f} | "
              f"{r.tpot_p50:.0f} | {r.tpot_p99:.0f} | {r.itl_p99:.0f} | {r.slow_gaps:.1%} | "
              f"{r.itl_max:.0f} | {r.goodput:.2f} | {r.completed} |")
    print("\nmedians:\n")
    print("| server | scenario | out tok/s | TTFT p50 ms | TPOT p50 ms | TPOT p99 ms | "
          "ITL p99 ms | gaps > 200 ms | ITL max ms | goodput req/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    med: dict[tuple[str, str], Run] = {}
    for key in sorted({(r.server, r.scenario) for r in runs}):
        rs = [r for r in runs if (r.server, r.scenario) == key]
        m = Run(key[0], key[1], statistics.median(r.out_tok_s for r in rs),
                statistics.median(r.tpot_p50 for r in rs),
                statistics.median(r.tpot_p99 for r in rs),
                statistics.median(r.ttft_p50 for r in rs), sum(r.completed for r in rs),
                statistics.median(r.itl_p99 for r in rs),
                statistics.median(r.goodput for r in rs),
                statistics.median(r.slow_gaps for r in rs),
                statistics.median(r.itl_max for r in rs))
        med[key] = m
        print(f"| {m.server} | {m.scenario} | {m.out_tok_s:.1f} | {m.ttft_p50:.0f} | "
              f"{m.tpot_p50:.0f} | {m.tpot_p99:.0f} | {m.itl_p99:.0f} | {m.slow_gaps:.1%} | "
              f"{m.itl_max:.0f} | {m.goodput:.2f} |")
    if ("vllm-cpu", "conc16") in med and ("pdmesh", "conc16") in med:
        ratio = med[("pdmesh", "conc16")].out_tok_s / med[("vllm-cpu", "conc16")].out_tok_s
        print(f"\nconcurrency 16, pdmesh / vllm-cpu output tok/s: {ratio:.2f}x")
    if not args.skip_offline:
        ceiling = offline_ceiling(model, 16)
        served = med[("pdmesh", "conc16")].out_tok_s
        print(f"offline LLM.generate (max_num_seqs=16): {ceiling:.1f} out tok/s; "
              f"served at concurrency 16: {served:.1f} ({served / ceiling:.0%} of offline)")


if __name__ == "__main__":
    main()
