"""`pdmesh bench <kind>`: benchmarks run from the command line.

    pdmesh bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --num-prompts 200 --request-rate 4 --goodput ttft:500 tpot:50 --save-result out.json

The logic lives in `pdmesh.bench_serve`; this module only parses flags and prints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from collections.abc import Sequence
from typing import Any

from pdmesh import bench_serve as bs
from pdmesh.slo import parse_goodput

DATASETS = ("random", "shared-prefix", "multi-turn")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdmesh bench serve",
                                description="online serving benchmark (OpenAI API, streaming)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=("/v1/completions", "/v1/chat/completions"))
    p.add_argument("--model", default="", help="model name to send; empty = the served one")
    p.add_argument("--api-key", default=None,
                   help="Bearer key (default: env PDMESH_API_KEY, then OPENAI_API_KEY)")
    p.add_argument("--tokenizer", default="smollm2",
                   help="model alias/path whose vocabulary makes prompts of exact token "
                        "lengths; 'none' = random words")
    p.add_argument("--dataset-name", default="random", choices=DATASETS)
    p.add_argument("--num-prompts", type=int, default=100, help="requests in all")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (sessions, for multi-turn); inf = at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--max-duration-s", type=float, default=None,
                   help="stop sending at this time limit; unfinished requests are dropped")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--shared-prefix-len", type=int, default=512)
    p.add_argument("--shared-prefix-groups", type=int, default=4)
    p.add_argument("--multi-turn-turns", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS itl:MS (itl: the longest gap "
                   "between two chunks of a request)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", default=None, metavar="PATH", help="write JSON here")
    p.add_argument("--label", default="", help="free text stored in the JSON result")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def _validate(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict[str, float]:
    for name in ("num_prompts", "random_input_len", "random_output_len", "shared_prefix_len",
                 "shared_prefix_groups", "multi_turn_turns"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if not a.request_rate > 0:
        p.error("--request-rate must be > 0 (inf for all at once)")
    if a.max_duration_s is not None and not a.max_duration_s > 0:
        p.error("--max-duration-s must be > 0")
    if not 0 <= a.random_range_ratio < 1:
        p.error("--random-range-ratio must be in [0, 1)")
    try:
        return parse_goodput(a.goodput)
    except ValueError as exc:
        p.error(str(exc))
        raise


def _tokenizer(name: str) -> Any | None:
    if name.lower() == "none":
        return None
    from transformers import AutoTokenizer

    from pdmesh.engine.model_store import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(name))


def build_sessions(a: argparse.Namespace, source: bs.PromptSource) -> list[bs.Session]:
    if a.dataset_name == "random":
        return bs.random_dataset(source, a.num_prompts, a.random_input_len,
                                 a.random_output_len, a.random_range_ratio)
    if a.dataset_name == "shared-prefix":
        return bs.shared_prefix_dataset(source, a.num_prompts, a.shared_prefix_groups,
                                        a.shared_prefix_len, a.random_input_len,
                                        a.random_output_len)
    return bs.multi_turn_dataset(source, a.num_prompts, a.multi_turn_turns,
                                 a.random_input_len, a.random_output_len)


def serve_main(argv: Sequence[str]) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    slos = _validate(parser, a)
    from tqdm.auto import tqdm

    source = bs.PromptSource(random.Random(a.seed), _tokenizer(a.tokenizer))
    sessions = build_sessions(a, source)
    settings = bs.RunSettings(
        base_url=a.base_url, endpoint=a.endpoint, model=a.model,
        api_key=a.api_key or os.environ.get("PDMESH_API_KEY") or os.environ.get(
            "OPENAI_API_KEY"),
        request_rate=a.request_rate, max_concurrency=a.max_concurrency,
        max_duration_s=a.max_duration_s, temperature=a.temperature,
        request_timeout_s=a.request_timeout_s, seed=a.seed, progress=not a.disable_tqdm,
    )
    total = sum(len(s.turns) for s in sessions)
    bar = tqdm(total=total, desc="requests", disable=a.disable_tqdm)
    results, duration = asyncio.run(
        bs.run_benchmark(settings, sessions, on_result=lambda _: bar.update(1))
    )
    bar.close()
    if not results:
        print("pdmesh bench serve: no request finished", file=sys.stderr)
        return 1
    metrics = bs.compute_metrics(results, duration, slos)
    print(bs.format_report(metrics))
    errors = sorted({r.error for r in results if not r.ok})
    for error in errors[:5]:
        print(f"error: {error}", file=sys.stderr)
    if a.save_result:
        dataset = {k: v for k, v in vars(a).items()
                   if k.startswith(("dataset", "random", "shared", "multi", "num_prompts",
                                    "tokenizer", "label"))}
        payload = bs.result_json(settings, dataset, metrics, results, slos)
        with open(a.save_result, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
    return 0 if metrics.completed else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: pdmesh bench serve [options]   (pdmesh bench serve --help)")
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"pdmesh bench: unknown benchmark {argv[0]!r}; available: serve", file=sys.stderr)
        return 2
    return serve_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
