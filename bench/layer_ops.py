"""The fused layer ops (kernels/layer_ops.py), per implementation, at decode and prefill sizes.

Times each op of one decoder layer (add+RMSNorm, RoPE in place on q and k, SiLU-and-mul) for
every implementation that runs here — `torch` (the reference formulas), `cpu`, and `triton`
on a CUDA device — at SmolLM2-135M shapes by default (hidden 576, intermediate 1536, 9 q heads,
3 kv heads, head size 64), medians of `--repeats` timings of `--iters` calls each, one thread
on CPU unless `--threads` says otherwise.

    .venv/bin/python bench/layer_ops.py [--tokens 1,16,64,512] [--shape llama3-8b]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from pdmesh.kernels.layer_ops import LAYER_OPS_NAMES, LayerOps, select_layer_ops

SHAPES = {  # hidden, intermediate, q heads, kv heads, head size
    "smollm2-135m": (576, 1536, 9, 3, 64),
    "llama3-8b": (4096, 14336, 32, 8, 128),
}


def timed(fn: Callable[[], object], iters: int, repeats: int, sync: Callable[[], None]) -> float:
    """Median microseconds per call."""
    for _ in range(3):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(samples)


def measure(ops: LayerOps, tokens: int, shape: tuple[int, ...], device: str, dtype: torch.dtype,
            iters: int, repeats: int) -> dict[str, float]:
    hidden, inter, q_heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(dtype).to(device)

    x, residual, weight = rand(tokens, hidden), rand(tokens, hidden), rand(hidden)
    qkv = rand(tokens, (q_heads + 2 * kv_heads) * dim)
    q = qkv[:, : q_heads * dim].view(tokens, q_heads, dim)
    k = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    cos, sin = rand(tokens, dim // 2), rand(tokens, dim // 2)
    gate_up = rand(tokens, 2 * inter)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return {
        "add_rms_norm": timed(lambda: ops.add_rms_norm(x, residual, weight, 1e-5), iters,
                              repeats, sync),
        "rope_": timed(lambda: ops.rope_(q, k, cos, sin), iters, repeats, sync),
        "silu_and_mul": timed(lambda: ops.silu_and_mul(gate_up), iters, repeats, sync),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,64,512")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    impls = []
    for name in LAYER_OPS_NAMES:
        try:
            impls.append(select_layer_ops(device, name))
        except ValueError:
            continue  # e.g. triton without CUDA
    print(f"{args.shape} {args.dtype} on {device} ({args.threads} thread(s)); "
          f"median us per call of {args.repeats} x {args.iters}")
    print(f"{'tokens':>6}  {'op':<13}" + "".join(f"{ops.name:>10}" for ops in impls))
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows = [measure(ops, tokens, SHAPES[args.shape], device, dtype, args.iters, args.repeats)
                for ops in impls]
        for op in rows[0]:
            print(f"{tokens:>6}  {op:<13}" + "".join(f"{row[op]:>10.1f}" for row in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
