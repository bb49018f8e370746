"""The host's share of a step: a large batch on a model whose compute costs next to nothing.

On a GPU the kernels of a batch-128 decode step of an 8B model take ~13.6 ms; everything the
host does per step (scheduling, inputs, sampling bookkeeping, outputs, detokenization, the
garbage collector) must fit beside that for the device to stay busy. This measures that host
work where it can be seen on a CPU: the `tiny` shape of bench/gpu_throughput.py (2 layers,
64 wide) with a 512-token vocabulary (random weights, SmolLM2's tokenizer), `--batch`
requests of 128 random ids, `--output-len` new tokens each, greedy, ignore_eos, through the
offline `LLM.generate`. Prints wall time per step and the garbage collector's collections
and seconds by generation during the run, per run.

    python bench/step_host.py                    # batch 128, 128 new tokens, 3 runs
    python bench/step_host.py --unfrozen         # the heap left unfrozen during generate (before)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_throughput import SHAPES, default_tokenizer_dir, write_model_dir

import pdmesh.engine.frontend.llm
from pdmesh import LLM, SamplingParams


class GcClock:
    """Collections and seconds spent in them, by generation (`gc.callbacks`)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            generation = info["generation"]
            self.count[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--unfrozen", action="store_true",
                    help="do not freeze the heap during generate (the behaviour before)")
    args = ap.parse_args()
    if args.unfrozen:
        pdmesh.engine.frontend.llm.frozen_heap = contextlib.nullcontext  # type: ignore[attr-defined]

    SHAPES["tiny-vocab"] = {**SHAPES["tiny"], "vocab_size": 512}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model_dir("tiny-vocab", Path(tmp), default_tokenizer_dir())
        llm = LLM(str(model), load_format="dummy", dtype="float32", device="cpu", seed=0,
                  max_num_seqs=max(256, args.batch), max_num_batched_tokens=8192,
                  kv_cache_memory="256MiB")
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [3, 4, 5]}] * 8,
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    print(f"batch {args.batch}, prompts of 128 random ids, {args.output_len} new tokens, "
          f"heap {'unfrozen' if args.unfrozen else 'frozen'} during generate\n")
    print("| run | s | steps | ms / step | out tok/s "
          "| GC collections (gen 0/1/2) | GC s (gen 0/1/2) |")
    print("|---:|---:|---:|---:|---:|---|---|")
    for run in range(1, args.runs + 1):
        prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(128)]}
                   for _ in range(args.batch)]
        clock = GcClock()
        gc.callbacks.append(clock)
        steps = llm.engine.core.num_steps
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        gc.callbacks.remove(clock)
        steps = llm.engine.core.num_steps - steps
        print(f"| {run} | {seconds:.2f} | {steps} | {seconds / steps * 1e3:.2f} "
              f"| {args.batch * args.output_len / seconds:.0f} "
              f"| {'/'.join(map(str, clock.count))} "
              f"| {'/'.join(f'{s:.3f}' for s in clock.seconds)} |")


if __name__ == "__main__":
    main()
