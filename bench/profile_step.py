"""Per-step decode breakdown of the offline_throughput --quick mixed workload.

Wraps the engine's parts with wall-clock timers (perf_counter; torch CPU ops are synchronous)
and reports milliseconds per decode-only step and per mixed step.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from offline_throughput import make_mixed

from pdmesh import LLM, SamplingParams

T = collections.defaultdict(float)
CUR: list[str] = []


CLOCK = [time.perf_counter]


def timed(name, fn):
    def wrapper(*a, **k):
        t0 = CLOCK[0]()
        try:
            return fn(*a, **k)
        finally:
            T[name] += CLOCK[0]() - t0

    return wrapper


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-pack", action="store_true")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_pack:
        import pdmesh.engine.model_runner as mr

        mr.can_pack_linears = lambda *a: False
    if args.clock == "thread":
        CLOCK[0] = time.thread_time
    llm = LLM(
        "smollm2",
        kv_cache_memory="2GiB",
        max_num_batched_tokens=2048,
        attention_backend=args.backend,
    )
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    reqs = make_mixed(args.n, vocab, (32, 512), (8, 64), 0)
    llm.generate({"prompt_token_ids": [100] * 8}, SamplingParams(max_tokens=2), use_tqdm=False)
    model = eng.model
    # wrap GEMMs
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        for name, mod in (
            ("gemm", a.qkv_proj),
            ("gemm", a.o_proj),
            ("gemm", m.gate_up_proj),
            ("gemm", m.down_proj),
        ):
            mod.forward = timed(name, mod.forward)
    ops = model.ops
    for name, label in (("rms_norm", "norm"), ("add_rms_norm", "norm"), ("rope_", "rope"),
                        ("silu_and_mul", "act")):
        setattr(ops, name, timed(label, getattr(ops, name)))
    if model.rope is not None:
        model.rope.lookup = timed("rope", model.rope.lookup)
    backend = eng.runner.backend
    backend.forward = timed("attention", backend.forward)
    model.lm_head.forward = timed("lm_head", model.lm_head.forward)
    eng.runner.prepare = timed("input_prep", eng.runner.prepare)
    eng.runner.execute = timed("model_total", eng.runner.execute)
    eng.sampler_orig = eng.sampler
    eng.scheduler.schedule = timed("schedule", eng.scheduler.schedule)
    eng._sample = timed("sample", eng._sample)
    step = eng.step
    stats = {"decode": collections.defaultdict(float), "mixed": collections.defaultdict(float)}
    counts = collections.Counter()
    batch_sizes = []

    def step_wrapped():
        T.clear()
        t0 = CLOCK[0]()
        out = step()
        total = CLOCK[0]() - t0
        sched_decode = eng.runner.last_kind if hasattr(eng.runner, "last_kind") else None
        del sched_decode
        kind = KIND[0]
        counts[kind] += 1
        d = stats[kind]
        d["step_total"] += total
        for k, v in T.items():
            d[k] += v
        return out

    KIND = ["decode"]
    prep = eng.runner.prepare

    def prep_kind(scheduled):
        KIND[0] = "decode" if all(s.num_new_tokens == 1 for s in scheduled) else "mixed"
        if KIND[0] == "decode":
            batch_sizes.append(len(scheduled))
        return prep(scheduled)

    eng.runner.prepare = prep_kind
    eng.step = step_wrapped
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    out_tokens = sum(o for _, o in reqs)
    print(
        f"torch threads={torch.get_num_threads()} backend={backend.name} wall={wall:.2f}s "
        f"out_tok/s={out_tokens / wall:.1f} steps={dict(counts)} "
        f"mean decode batch={sum(batch_sizes) / max(1, len(batch_sizes)):.1f}"
    )
    for kind in ("decode", "mixed"):
        n = counts[kind]
        if not n:
            continue
        d = stats[kind]
        model_inner = d["gemm"] + d["attention"] + d["norm"] + d["rope"] + d["lm_head"]
        rows = [
            ("schedule", d["schedule"]),
            ("input prep", d["input_prep"]),
            ("GEMMs (qkv/o/gate_up/down)", d["gemm"]),
            ("attention (incl. cache write)", d["attention"]),
            ("RMSNorm", d["norm"]),
            ("RoPE", d["rope"]),
            ("LM head", d["lm_head"]),
            ("other model Python/ops", d["model_total"] - model_inner),
            ("sampling", d["sample"]),
            (
                "engine bookkeeping",
                d["step_total"] - d["schedule"] - d["input_prep"] - d["model_total"] - d["sample"],
            ),
        ]
        print(f"\n{kind} steps: {n}, {1000 * d['step_total'] / n:.2f} ms/step")
        for name, v in rows:
            print(f"  {name:<32} {1000 * v / n:8.3f} ms  {100 * v / d['step_total']:5.1f}%")


if __name__ == "__main__":
    main()
