"""Disaggregated (1 prefill + 1 decode) vs colocated serving on this machine, through the
OpenAI gateway, with `pdmesh bench serve` as the load generator (a separate process).

For each mode a fresh local mesh is started (`pdmesh serve` machinery), then the same seeded
random workload is sent at each request rate; the table shows throughput, TTFT and TPOT.

    python bench/pd_vs_colocated.py                        # rates 0.5 and 2 req/s, 24 prompts
    python bench/pd_vs_colocated.py --rates 1 4 --num-prompts 48
    # long prompts at equal compute per engine (every engine on the same --cpu-threads; by
    # default a P/D prefill engine gets half the threads of a colocated one on 2 cores):
    python bench/pd_vs_colocated.py --input-len 2048 --output-len 16 --rates 1 \
        --num-prompts 8 --cpu-threads 1

Admission by predicted wait is off (`max_queue_delay_s=0`): the table measures serving, and
long prompts past the machine's prefill rate would otherwise be refused, not queued.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from pdmesh.engine.config import EngineConfig
from pdmesh.serve import LocalMesh, MeshConfig, pdmesh_command

MODES = {
    "colocated": {"colocated": True, "num_decode": 1},
    "1P+1D": {"num_prefill": 1, "num_decode": 1, "local_prefill_threshold": 0},
    # the same mesh with the whole prompt's KV moved after the prefill (no chunk streaming)
    "1P+1D unary": {"num_prefill": 1, "num_decode": 1, "local_prefill_threshold": 0,
                    "kv_stream_chunks": False},
}


def run_bench(url: str, rate: float, args: argparse.Namespace, out: Path) -> dict:
    cmd = pdmesh_command(
        "bench", "serve", "--base-url", url.removesuffix("/v1"), "--dataset-name", "random",
        "--num-prompts", str(args.num_prompts), "--request-rate", str(rate),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--max-duration-s", str(args.max_duration_s), "--seed", str(args.seed),
        "--save-result", str(out), "--disable-tqdm",
    )  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["metrics"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 2.0])
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-duration-s", type=float, default=240)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="torch threads of every engine (equal compute per engine)")
    args = ap.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode, overrides in MODES.items():
            engine = EngineConfig(cpu_threads=args.cpu_threads,
                                  max_model_len=args.input_len + args.output_len + 256)
            config = MeshConfig(gateway_port=0, kv_cache_memory=args.kv_cache_memory,
                                engine=engine, max_queue_delay_s=0, **overrides)
            with LocalMesh(config) as mesh:
                assert mesh.gateway_url is not None
                for rate in args.rates:
                    out = Path(tmp) / f"{mode}-{rate}.json"
                    rows.append((mode, rate, run_bench(mesh.gateway_url, rate, args, out)))
                    print(f"done: {mode} at {rate} req/s", file=sys.stderr)

    print(f"\nrandom dataset: {args.num_prompts} prompts, ~{args.input_len} tokens in, "
          f"~{args.output_len} out, Poisson arrivals, seed {args.seed}")
    header = ("| mode | rate req/s | done | req/s | out tok/s | TTFT p50 ms | TTFT mean ms "
              "| TTFT p99 ms | TPOT mean ms | TPOT p99 ms |")
    print(header)
    print("|" + "|".join("---" for _ in range(10)) + "|")
    for mode, rate, m in rows:
        print(f"| {mode} | {rate:g} | {m['completed']} | {m['request_throughput']:.2f} "
              f"| {m['output_throughput']:.1f} | {m['ttft_ms']['median']:.0f} "
              f"| {m['ttft_ms']['mean']:.0f} | {m['ttft_ms']['p99']:.0f} "
              f"| {m['tpot_ms']['mean']:.0f} | {m['tpot_ms']['p99']:.0f} |")


if __name__ == "__main__":
    main()
