"""Paged decode attention on CPU: the engine's CPU path against a naive gather + SDPA, the
torch reference, and the memory-bandwidth floor, for one layer of a decode step.

    python bench/attention.py            # SmolLM2-135M and Llama-3-8B head shapes (~1 min)
    python bench/attention.py --quick    # fewer shapes, shorter timing (~15 s)
    python bench/attention.py --step 30  # one decode step: 30 layers' distinct caches

`--step N` times what a decode step of the served benchmark asks (SmolLM2's heads, 16
sequences of ~300 tokens) over N layers of distinct caches, as the engine runs them: no layer's
K/V is still in cache when it is read, so memory stalls count (one layer timed alone hides them).

- naive: what a first implementation does: per sequence, gather its blocks with advanced
  indexing, repeat the KV heads for GQA, SDPA.
- reference: `torch_ref.paged_decode_attention` (one batched advanced-index gather + SDPA).
- gather+SDPA: `cpu_attention.sdpa_decode_attention`, the engine's torch CPU path.
- native: `cpu_native.paged_decode_attention`, the C kernel the engine uses where it builds.
- floor: K/V bytes the step must read ÷ measured memory bandwidth (a large `copy_`, counting
  bytes read + written): no kernel can read the context faster.

Each cell is the best of repeated runs within a time budget (wall clock); the three
implementations are checked to agree before they are timed.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdmesh.kernels import cpu_attention, cpu_native, torch_ref
from pdmesh.kernels.backend import AttentionMetadata


@dataclass(frozen=True)
class Shape:
    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


SHAPES = [Shape("SmolLM2-135M", 9, 3, 64), Shape("Llama-3-8B", 32, 8, 128)]


@dataclass
class Case:
    query: torch.Tensor
    kv_layer: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: float

    @property
    def kv_bytes(self) -> int:
        _, _, _, heads, dim = self.kv_layer.shape
        return 2 * int(self.seq_lens.sum()) * heads * dim * self.kv_layer.element_size()

    def meta(self) -> AttentionMetadata:
        batch = self.query.shape[0]
        return AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long),
            num_decode_tokens=batch,
            decode_block_tables=self.block_tables,
            decode_seq_lens=self.seq_lens,
            prefill_query_start_loc=[0],
            prefill_seq_lens=[],
            prefill_block_tables=self.block_tables[:0],
        )


def make_case(shape: Shape, batch: int, ctx: int, block_size: int, seed: int) -> Case:
    """`batch` sequences of about `ctx` tokens (±25 %, not block multiples), blocks scattered
    over a cache with 25 % spare blocks."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, ctx * 3 // 4), ctx * 5 // 4 + 1, (batch,), generator=gen)
    need = (lens + block_size - 1) // block_size
    num_blocks = int(need.sum()) * 5 // 4 + 1
    kv = torch.randn(2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(batch, int(need.max()), dtype=torch.long)
    used = 0
    for i, n in enumerate(need.tolist()):
        tables[i, :n] = order[used : used + n]
        used += n
    query = torch.randn(batch, shape.num_q_heads, shape.head_dim, generator=gen)
    return Case(query, kv, tables, lens, shape.head_dim**-0.5)


def naive(case: Case) -> torch.Tensor:
    out = torch.empty_like(case.query)
    block_size = case.kv_layer.shape[2]
    group = case.query.shape[1] // case.kv_layer.shape[3]
    for i, n in enumerate(case.seq_lens.tolist()):
        blocks = case.kv_layer[:, case.block_tables[i, : -(-n // block_size)]]
        kv = blocks.flatten(1, 2)[:, :n].transpose(1, 2)  # [2, Hkv, n, D]
        k = kv[0].repeat_interleave(group, 0)
        v = kv[1].repeat_interleave(group, 0)
        q = case.query[i].unsqueeze(1)  # [Hq, 1, D]
        out[i] = F.scaled_dot_product_attention(q, k, v, scale=case.scale).squeeze(1)
    return out


def reference(case: Case) -> torch.Tensor:
    return torch_ref.paged_decode_attention(
        case.query, case.kv_layer, case.block_tables, case.seq_lens, case.scale
    )


def cpu_path(case: Case) -> torch.Tensor:
    # A fresh metadata object per call: the per-step layout is part of what is timed.
    return cpu_attention.sdpa_decode_attention(case.query, case.kv_layer, case.meta(), case.scale)


def native(case: Case) -> torch.Tensor:
    return cpu_native.paged_decode_attention(case.query, case.kv_layer, case.block_tables,
                                             case.seq_lens, case.scale)


def best_seconds(fn: Callable[[], object], budget_s: float, max_runs: int = 200) -> float:
    fn()  # warm-up
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    for _ in range(max_runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    return best


def copy_bandwidth(budget_s: float) -> float:
    """Bytes moved per second (read + write) by a copy far larger than the caches."""
    src = torch.ones(64 * 2**20 // 4 * 4)  # 256 MiB
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), budget_s, max_runs=20)
    return 2 * src.numel() * src.element_size() / seconds


def step_table(layers: int, block_size: int, bandwidth: float, runs: int = 15) -> None:
    """One decode step's attention over `layers` distinct caches: native and gather + SDPA."""
    shape = SHAPES[0]
    cases = [make_case(shape, 16, 300, block_size, seed=i) for i in range(layers)]
    kv_bytes = sum(c.kv_bytes for c in cases)
    fns = [native, cpu_path] if cpu_native.library() is not None else [cpu_path]
    for fn in fns:
        torch.testing.assert_close(fn(cases[0]), reference(cases[0]), atol=1e-5, rtol=1e-4)
    print(f"{layers} layers x 16 sequences of ~300 tokens, {shape.name} heads, "
          f"{kv_bytes / 1e6:.0f} MB of K/V, floor {1e3 * kv_bytes / bandwidth:.1f} ms "
          "(as the table's floor: the bytes at the copy bandwidth)\n")
    print("| path | step ms | K/V GB/s |\n|---|---:|---:|")
    for fn in fns:
        best = float("inf")
        for _ in range(runs):
            t0 = time.perf_counter()
            for case in cases:
                fn(case)
            best = min(best, time.perf_counter() - t0)
        print(f"| {fn.__name__} | {1e3 * best:.2f} | {kv_bytes / best / 1e9:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.4, help="seconds of timing per cell")
    ap.add_argument("--step", type=int, default=0, metavar="LAYERS",
                    help="time one decode step over LAYERS distinct layer caches instead")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.step:
        with torch.inference_mode():
            step_table(args.step, args.block_size, copy_bandwidth(args.budget))
        return
    batches, contexts = ((1, 8), (512,)) if args.quick else ((1, 8, 32), (512, 2048))
    budget = args.budget / 2 if args.quick else args.budget
    shapes = SHAPES[:1] if args.quick else SHAPES
    bandwidth = copy_bandwidth(budget)
    print(
        f"torch {torch.__version__}, threads={torch.get_num_threads()}, float32, "
        f"block_size={args.block_size}, copy bandwidth {bandwidth / 1e9:.1f} GB/s (read+write)"
    )
    fns = [native, cpu_path, reference, naive]
    if cpu_native.library() is None:
        print("native kernels unavailable (no C compiler?): that column is left out")
        fns.remove(native)
    print(
        f"| {'heads q/kv x dim':<24} | {'batch':>5} | {'ctx':>5} | {'KV MB':>6} | "
        f"{'floor ms':>8} | {'native':>8} | {'gather+SDPA':>11} | {'reference':>9} | "
        f"{'naive':>8} | {'native/floor':>12} | {'SDPA/native':>11} |"
    )
    print("|" + "|".join("-" * w for w in (26, 7, 7, 8, 10, 10, 13, 11, 10, 14, 13)) + "|")
    with torch.inference_mode():
        for shape in shapes:
            for batch in batches:
                for ctx in contexts:
                    case = make_case(shape, batch, ctx, args.block_size, seed=batch * ctx)
                    expected = reference(case)
                    for fn in fns:
                        torch.testing.assert_close(fn(case), expected, atol=1e-5, rtol=1e-4)
                    floor = case.kv_bytes / bandwidth
                    ms = {
                        fn.__name__: 1e3 * best_seconds(lambda fn=fn, c=case: fn(c), budget)
                        for fn in fns
                    }
                    nat = ms.get("native", float("nan"))
                    label = (
                        f"{shape.name} {shape.num_q_heads}/{shape.num_kv_heads}x{shape.head_dim}"
                    )
                    print(
                        f"| {label:<24} | {batch:>5} | {ctx:>5} | {case.kv_bytes / 1e6:6.1f} | "
                        f"{floor * 1e3:8.3f} | {nat:8.3f} | {ms['cpu_path']:11.3f} | "
                        f"{ms['reference']:9.3f} | {ms['naive']:8.3f} | "
                        f"{nat / (floor * 1e3):11.1f}x | {ms['cpu_path'] / nat:10.1f}x |"
                    )


if __name__ == "__main__":
    main()
