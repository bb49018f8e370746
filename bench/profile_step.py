"""Where the engine's steps go, on the served benchmark's shape, offline.

The workload of `bench/serving_peer.py` run through `LLM.generate`: `--requests` prompts of
256 random token ids, 64 tokens out (ignore_eos), `max_num_seqs=16`, sampled as the servers
sample by default (SmolLM2's generation config: temperature 0.2, top-p 0.9; `--greedy` for
argmax). Each part of the engine is wrapped with a wall-clock timer (torch CPU ops are
synchronous) and the table gives milliseconds per step, for decode-only steps and for steps
that carry prompt tokens.

    .venv/bin/python bench/profile_step.py [--requests 48] [--greedy]
    PDMESH_CPU_KERNELS=0 .venv/bin/python bench/profile_step.py   # the torch path, to compare
"""

from __future__ import annotations

import argparse
import collections
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from pdmesh import LLM, SamplingParams

Totals = collections.defaultdict[str, float]


def timed(totals: Totals, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - started

    return wrapper


def instrument(llm: LLM, totals: Totals) -> Callable[[], tuple[str, int]]:
    """Wrap the parts of one step; returns a function naming the last step's kind and the
    tokens it computed."""
    core = llm.engine.core
    runner = core.runner
    model = runner.model
    for layer in model.layers:
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj):
            module.forward = timed(totals, "GEMMs (qkv, o, gate_up, down)", module.forward)
    model.lm_head.forward = timed(totals, "LM head", model.lm_head.forward)
    ops = model.ops
    for name, label in (("rms_norm", "RMSNorm (+ residual add)"),
                        ("add_rms_norm", "RMSNorm (+ residual add)"),
                        ("rope_", "RoPE"), ("silu_and_mul", "SiLU-and-mul")):
        setattr(ops, name, timed(totals, label, getattr(ops, name)))
    backend = runner.backend
    backend.forward = timed(totals, "attention (incl. cache write)", backend.forward)
    core.scheduler.schedule = timed(totals, "schedule", core.scheduler.schedule)
    runner.sampling.sampler = timed(totals, "sampling", runner.sampling.sampler)
    execute = timed(totals, "model (total)", runner.execute)
    runner.execute = execute
    kind: list[Any] = ["decode", 0]
    prepare = timed(totals, "input prep", runner.prepare)

    def prepare_and_classify(scheduled: Any, pending: Any = None) -> Any:
        kind[0] = ("decode" if all(s.num_new_tokens == 1 for s in scheduled) else "prompt")
        kind[1] = sum(s.num_new_tokens for s in scheduled)
        return prepare(scheduled, pending)

    runner.prepare = prepare_and_classify
    return lambda: (kind[0], kind[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--itl-target-ms", type=float, default=None,
                    help="the engine's ITL target (default: auto; 0: off)")
    ap.add_argument("--dtype", default="auto", help="weights and KV dtype (auto: float32 on CPU)")
    args = ap.parse_args()
    llm = LLM("smollm2", max_num_seqs=16, itl_target_ms=args.itl_target_ms, dtype=args.dtype)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(256)]}
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0 if args.greedy else 0.2, top_p=1.0 if args.greedy
                            else 0.9, max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm: kernels built, caches touched

    totals: Totals = collections.defaultdict(float)
    kind_of_last = instrument(llm, totals)
    per_kind: dict[str, Totals] = {k: collections.defaultdict(float) for k in ("decode", "prompt")}
    steps: collections.Counter[str] = collections.Counter()
    tokens: collections.Counter[str] = collections.Counter()
    step = llm.engine.step

    def step_and_record() -> Any:
        totals.clear()
        started = time.perf_counter()
        out = step()
        elapsed = time.perf_counter() - started
        kind, computed = kind_of_last()
        steps[kind] += 1
        tokens[kind] += computed
        per_kind[kind]["step"] += elapsed
        for name, value in totals.items():
            per_kind[kind][name] += value
        return out

    llm.engine.step = step_and_record  # type: ignore[method-assign]
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, backend="
          f"{llm.engine.core.runner.backend.name}, {args.requests} requests, "
          f"{'greedy' if args.greedy else 'temperature 0.2 / top-p 0.9'}: {wall:.1f} s, "
          f"{args.requests * 64 / wall:.1f} out tok/s\n")
    parts = ["GEMMs (qkv, o, gate_up, down)", "LM head", "attention (incl. cache write)",
             "RMSNorm (+ residual add)", "RoPE", "SiLU-and-mul"]
    print("| part | decode-only step, ms | step with prompt tokens, ms |")
    print("|---|---:|---:|")
    rows: list[tuple[str, Callable[[Totals], float]]] = [(p, lambda d, p=p: d[p]) for p in parts]
    rows += [
        ("other model ops (embedding, RoPE tables, Python)",
         lambda d: d["model (total)"] - sum(d[p] for p in parts)),
        ("sampling", lambda d: d["sampling"]),
        ("schedule + input prep + bookkeeping",
         lambda d: d["step"] - d["model (total)"] - d["sampling"]),
        ("**step**", lambda d: d["step"]),
    ]
    for name, value in rows:
        cells = [f"{1000 * value(per_kind[k]) / steps[k]:.1f}" if steps[k] else "-"
                 for k in ("decode", "prompt")]
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    print(f"\nsteps: {steps['decode']} decode-only, {steps['prompt']} with prompt tokens; "
          f"tokens per step: {tokens['decode'] / max(steps['decode'], 1):.1f} and "
          f"{tokens['prompt'] / max(steps['prompt'], 1):.1f}")


if __name__ == "__main__":
    main()
