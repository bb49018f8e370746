"""Offline throughput: pdmesh `LLM.generate` vs transformers `generate` in static batches.

Workload 1 (mixed): N requests, random prompt lengths and output lengths (ignore_eos), seeded.
Transformers runs them the way people use it without a serving engine: static batches,
left-padded, each batch running until its longest request is done.
Workload 2 (shared prefix): G long system prompts x Q questions, with and without prefix caching.

    python bench/offline_throughput.py                 # the full run (several minutes on 2 cores)
    python bench/offline_throughput.py --quick         # a smaller smoke run
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch

from pdmesh import LLM, SamplingParams


@dataclass
class Result:
    name: str
    seconds: float
    requests: int
    output_tokens: int

    @property
    def req_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds


def make_mixed(
    n: int, vocab: int, in_range: tuple[int, int], out_range: tuple[int, int], seed: int
):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = rng.randint(*in_range)
        # Avoid special tokens at the low end of the vocab.
        prompt = [rng.randint(100, vocab - 1) for _ in range(plen)]
        reqs.append((prompt, rng.randint(*out_range)))
    return reqs


def run_pdmesh(llm: LLM, reqs) -> Result:
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(o for _, o in reqs)
    return Result("pdmesh LLM.generate", dt, len(reqs), produced)


def run_hf(model, reqs, batch_size: int, pad_id: int) -> Result:
    t0 = time.perf_counter()
    useful = 0
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        max_new = max(o for _, o in batch)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad_id,
            )
        useful += sum(o for _, o in batch)
    dt = time.perf_counter() - t0
    return Result(f"transformers generate (static batch {batch_size})", dt, len(reqs), useful)


def print_table(title: str, rows: list[Result], baseline: Result | None = None) -> None:
    print(f"\n{title}")
    print(f"| {'engine':<42} | {'time s':>8} | {'req/s':>7} | {'out tok/s':>9} | {'ratio':>6} |")
    print(f"|{'-' * 44}|{'-' * 10}|{'-' * 9}|{'-' * 11}|{'-' * 8}|")
    for r in rows:
        ratio = r.tok_per_s / baseline.tok_per_s if baseline else 1.0
        print(
            f"| {r.name:<42} | {r.seconds:8.1f} | {r.req_per_s:7.2f} | {r.tok_per_s:9.1f} "
            f"| {ratio:5.2f}x |"
        )


def shared_prefix(args: argparse.Namespace) -> None:
    from transformers import AutoConfig

    from pdmesh.engine.model_store import resolve_model

    vocab = AutoConfig.from_pretrained(resolve_model(args.model)).vocab_size
    rng = random.Random(args.seed + 1)
    systems = [
        [rng.randint(100, vocab - 1) for _ in range(args.prefix_len)] for _ in range(args.groups)
    ]
    prompts = []
    for q in range(args.questions):
        for g in range(args.groups):
            question = [rng.randint(100, vocab - 1) for _ in range(24)]
            prompts.append({"prompt_token_ids": systems[g] + question})
        del q
    params = SamplingParams(temperature=0, max_tokens=args.prefix_out, ignore_eos=True)
    rows = []
    for caching in (False, True):
        llm = LLM(
            args.model,
            enable_prefix_caching=caching,
            kv_cache_memory="1GiB",
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        stats = llm.engine.kv_manager.stats
        rows.append((caching, dt, stats.hit_rate))
        del llm
    print(
        f"\nShared prefix: {args.groups} system prompts x {args.questions} questions, "
        f"prefix {args.prefix_len} tokens, {args.prefix_out} output tokens"
    )
    print(f"| {'prefix caching':<15} | {'time s':>8} | {'hit rate':>8} | {'speed-up':>8} |")
    print(f"|{'-' * 17}|{'-' * 10}|{'-' * 10}|{'-' * 10}|")
    for caching, dt, hit in rows:
        print(
            f"| {'on' if caching else 'off':<15} | {dt:8.1f} | {hit:8.1%} | "
            f"{rows[0][1] / dt:7.2f}x |"
        )


def run_mixed(args: argparse.Namespace) -> None:
    llm = LLM(
        args.model, kv_cache_memory="2GiB", max_num_batched_tokens=args.max_num_batched_tokens
    )
    vocab = llm.engine.model_config.vocab_size
    reqs = make_mixed(
        args.num_requests, vocab, tuple(args.input_len), tuple(args.output_len), args.seed
    )
    llm.generate({"prompt_token_ids": [100] * 8}, SamplingParams(max_tokens=2), use_tqdm=False)
    ours = run_pdmesh(llm, reqs)
    rows = [ours]
    baseline = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32)
        pad = llm.get_tokenizer().pad_token_id or 0
        baseline = run_hf(model, reqs, args.hf_batch_size, pad)
        rows.append(baseline)
        del model
    del llm
    print_table(
        f"Mixed workload: {args.num_requests} requests, prompts {args.input_len[0]}-"
        f"{args.input_len[1]} tokens, outputs {args.output_len[0]}-{args.output_len[1]} "
        "tokens (ignore_eos), greedy, float32",
        rows,
        baseline,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--prefix-out", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument("--skip-mixed", action="store_true", help="only the shared-prefix workload")
    ap.add_argument("--quick", action="store_true", help="16 requests, short outputs")
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.output_len = 16, (8, 64)
        args.groups, args.questions, args.prefix_len = 4, 4, 256

    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}")
    if not args.skip_mixed:
        run_mixed(args)
    if not args.skip_prefix:
        shared_prefix(args)


if __name__ == "__main__":
    main()
