"""The sampler's cost per decode step: `Sampler.sample_ids` on one batch of logits.

Random logits of a real vocabulary (49152, SmolLM2's), one row per sequence of the batch, for
the sampling settings servers see most: greedy, plain temperature (the OpenAI default, no
top-p), temperature with top-p (the model's generation config), min-p, and seeded rows. Each
is timed over repeated steps after a warm-up; the table is ms per step (median of --repeats).

    python bench/sampler.py                     # batch 16, the engine core's 2 threads
    python bench/sampler.py --batch 64 --threads 4
    python bench/sampler.py --default-allocator # glibc's thresholds left as they start

An engine on a CPU device fixes glibc's mmap / trim thresholds (engine/core/host_allocator.py), so
this does too unless told otherwise: a megabyte-sized temporary then costs no page faults.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable

import torch

from pdmesh.engine.core.host_allocator import keep_temporaries_on_heap
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.worker.sampler import Sampler, SamplingMetadata, make_generator

SETTINGS: dict[str, Callable[[int], SamplingParams]] = {
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "temperature 1.0": lambda i: SamplingParams(temperature=1.0),
    "temperature 0.7, top-p 1.0": lambda i: SamplingParams(temperature=0.7, top_p=1.0),
    "temperature 0.2, top-p 0.9": lambda i: SamplingParams(temperature=0.2, top_p=0.9),
    "temperature 0.8, min-p 0.05": lambda i: SamplingParams(temperature=0.8, min_p=0.05),
    "temperature 1.0, seeded": lambda i: SamplingParams(temperature=1.0, seed=i),
    "half seeded, half temperature 1.0": lambda i: SamplingParams(
        temperature=1.0, seed=i if i % 2 else None),
}


def step_ms(logits: torch.Tensor, params: list[SamplingParams], steps: int) -> float:
    sampler = Sampler(seed=0)
    generators = [make_generator(p.seed) for p in params]
    rows = len(params)
    meta = SamplingMetadata(params, generators, [[1, 2, 3]] * rows, [[]] * rows, set())
    for _ in range(3):
        sampler.sample_ids(logits, meta)
    started = time.perf_counter()
    for _ in range(steps):
        sampler.sample_ids(logits, meta)
    return (time.perf_counter() - started) / steps * 1e3


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--default-allocator", action="store_true",
                        help="leave glibc's allocation thresholds as they are")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tuned = False if args.default_allocator else keep_temporaries_on_heap()
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    print(f"batch {args.batch}, vocab {args.vocab}, {args.threads} threads, "
          f"torch {torch.__version__}, heap thresholds fixed: {tuned}\n")
    print("| sampling | ms per step | page faults per step |")
    print("|---|---|---|")
    for name, make in SETTINGS.items():
        params = [make(i) for i in range(args.batch)]
        times = [step_ms(logits, params, args.steps) for _ in range(args.repeats)]
        faults = minor_faults()
        step_ms(logits, params, args.steps)
        per_step = (minor_faults() - faults) / args.steps
        print(f"| {name} | {statistics.median(times):.2f} | {per_step:.0f} |")


if __name__ == "__main__":
    main()
