"""CPU linear layers at a decode step's rows: the native packed GEMM against oneDNN's packing
and `F.linear`, over a whole model's distinct weights.

The four projections of SmolLM2-135M's 30 layers (qkv 576->960, o 576->576, gate_up
576->3072, down 1536->576: 425 MB in float32), each layer's weights distinct, so they stream
from memory as in the engine (one weight timed in a loop sits in cache and hides that). Rows
(M) from one decode row to a prefill chunk. Best of `--runs`, float32, torch's threads.

    .venv/bin/python bench/linear.py [--rows 1,4,16,32,128,256] [--runs 4]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pdmesh.engine.worker.models.packed_linear import PackedLinear
from pdmesh.kernels import cpu_native

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out) per projection
LAYERS = 30


def timed(fn: Callable[[], object], runs: int) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,32,128,256")
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    linears = [[nn.Linear(i, o, bias=False) for i, o in SHAPES] for _ in range(LAYERS)]
    weights = [[lin.weight.detach() for lin in layer] for layer in linears]
    native_ok = cpu_native.supports_linear(weights[0][0])
    native = ([[cpu_native.pack_linear_weight(w) for w in layer] for layer in weights]
              if native_ok else [])
    onednn = [[PackedLinear(lin, native=False) for lin in layer] for layer in linears]
    size = sum(w.numel() * 4 for layer in weights for w in layer)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, {LAYERS} layers x "
          f"{len(SHAPES)} projections, {size / 1e6:.0f} MB of float32 weights"
          + ("" if native_ok else "; native kernel not used on this CPU (no AVX-512 or no build)"))
    print("\n| rows | native ms | oneDNN packed ms | F.linear ms |\n|---:|---:|---:|---:|")
    paths: dict[str, Callable[[dict[int, torch.Tensor]], object]] = {
        "onednn": lambda xs: [p(xs[i]) for layer in onednn
                              for (i, _), p in zip(SHAPES, layer, strict=True)],
        "plain": lambda xs: [F.linear(xs[i], w) for layer in weights
                             for (i, _), w in zip(SHAPES, layer, strict=True)],
    }
    if native_ok:
        paths["native"] = lambda xs: [cpu_native.linear(xs[i], p, o) for layer in native
                                      for (i, o), p in zip(SHAPES, layer, strict=True)]
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {i: torch.randn(rows, i) for i in {i for i, _ in SHAPES}}
            got = {name: timed(partial(fn, xs), args.runs) for name, fn in paths.items()}
            cells = [f"{1e3 * got[k]:.1f}" if k in got else "-"
                     for k in ("native", "onednn", "plain")]
            print(f"| {rows} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
