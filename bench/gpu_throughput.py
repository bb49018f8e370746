"""GPU throughput: pdmesh `LLM.generate` vs transformers `generate_batch`, random-weight models.

Builds model directories on the fly (config.json of a shape + SmolLM2's tokenizer files, vocab
49152; no weights on disk: both engines get the same random weights, `--load-format dummy`),
then per shape:

- the fixed workload of issue 9: N requests, prompt lengths uniform in [lo, hi] of random ids
  (seeded), M new tokens each, greedy, ignore_eos, through pdmesh's offline `LLM.generate` and
  through transformers' continuous batching (`generate_batch`); output tokens per second;
- a decode step at batch B: wall time per step, device kernel time per step (torch.profiler,
  union of kernel intervals) and how busy that keeps the device;
- one stream alone (prompt P, M new tokens): ms per token and tokens per second, against the
  floor of reading every weight once per token (weight bytes / `--hbm-bandwidth`).

On a CPU-only machine the "kernel" time is torch.profiler's CPU op time: labelled so.

    python bench/gpu_throughput.py                                   # on a lent H100
    python bench/gpu_throughput.py --shapes tiny --num-requests 8 --input-len 16 64 \\
        --output-len 16 --decode-batch 4 --single-prompt 32 --hf-num-blocks 64    # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdmesh import LLM, SamplingParams
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.worker.checkpoint_names import hf_state_dict
from pdmesh.engine.worker.model_loader import load_model
from pdmesh.engine.worker.models.architecture import ModelConfig
from pdmesh.engine.worker.models.llama import LlamaForCausalLM

VOCAB = 49152  # SmolLM2's tokenizer, whose files every model directory gets a copy of

_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "vocab_size": VOCAB,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    "llama3.2-1b": {
        **_LLAMA3,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
    },
    "tiny": {  # CPU smoke runs: the code paths of the real shapes in seconds
        **_LLAMA3,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "chat_template.jinja")


@dataclass(frozen=True)
class Row:
    """One line of the table: `key` names it in the JSON output."""

    key: str
    label: str
    value: float | None
    fmt: str = "{:.1f}"

    def text(self) -> str:
        return "n/a" if self.value is None else self.fmt.format(self.value)


@dataclass
class ShapeResult:
    shape: str
    device: str
    dtype: str
    weight_bytes: int
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# -- model directories ------------------------------------------------------------------------


def write_model_dir(shape: str, dest: Path, tokenizer_dir: Path) -> Path:
    """`dest` with the shape's config.json and the tokenizer's files; no weights."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(SHAPES[shape], indent=2))
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, dest / name)
    if not (dest / "tokenizer.json").is_file():
        raise SystemExit(f"--tokenizer {tokenizer_dir}: no tokenizer.json there")
    return dest


def default_tokenizer_dir() -> Path:
    from pdmesh.engine.model_store import resolve_model

    return resolve_model("smollm2")


# -- workload ---------------------------------------------------------------------------------


def random_prompts(n: int, lengths: tuple[int, int], seed: int, vocab: int = VOCAB
                   ) -> list[list[int]]:
    """`n` prompts of random ids (above the special tokens), lengths uniform in `lengths`."""
    rng = random.Random(seed)
    return [[rng.randint(100, vocab - 1) for _ in range(rng.randint(*lengths))]
            for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# -- measurements -----------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def busy_us(events: list[Any], device_type: Any) -> float:
    """Microseconds covered by the union of the events' intervals on `device_type`."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == device_type)
    total, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def profiled(fn: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """(busy ms, wall ms) of `fn` under torch.profiler: busy is the union of the device's
    kernel intervals on CUDA, of torch op intervals on CPU (time outside Python glue)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    busy = busy_us(prof.events(), DeviceType.CUDA if cuda else DeviceType.CPU)
    return busy / 1e3, wall_ms


def run_pdmesh_workload(llm: LLM, prompts: list[list[int]], new_tokens: int
                        ) -> tuple[float, list[list[int]]]:
    """Seconds for the whole workload and each request's output ids."""
    inputs = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    outs = llm.generate(inputs, greedy(new_tokens), use_tqdm=False)
    seconds = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outs]
    if any(len(t) != new_tokens for t in ids):
        raise RuntimeError("pdmesh: a request stopped before its max_tokens")
    return seconds, ids


def decode_step(llm: LLM, prompts: list[list[int]], steps: int, device: torch.device
                ) -> tuple[float, float, float, int]:
    """(wall ms per step, busy ms per step, busy %, smallest batch seen) of decode-only steps
    with every prompt running: warmed up, `steps` timed plainly, then `steps` profiled."""
    engine = llm.engine
    ids = [f"decode-step-{i}" for i in range(len(prompts))]
    budget = 3 * steps + 2 * sum(len(p) for p in prompts) // 64 + 64  # never finishes first
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": prompt}, greedy(budget))
    try:
        started: set[str] = set()
        deadline = time.monotonic() + 1800
        while len(started) < len(ids):  # prefill every prompt (chunked, mixed with decodes)
            if time.monotonic() > deadline:
                raise TimeoutError("decode step: prompts not prefilled within 30 min")
            started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
        seen = len(ids)

        def run() -> None:
            nonlocal seen
            for _ in range(steps):
                seen = min(seen, len(engine.step()))

        run()  # warm-up: decode-only shapes at this batch
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
        busy_ms, profiled_wall_ms = profiled(run, device)
        # GPU kernels run as fast profiled or not: their share of the plain wall time. On CPU
        # the profiler slows the ops it records, so their share of the profiled window.
        busy_pct = 100 * busy_ms / (wall_ms * steps if device.type == "cuda" else profiled_wall_ms)
        return wall_ms, busy_ms / steps, busy_pct, seen
    finally:
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()


def single_stream(llm: LLM, prompt: list[int], new_tokens: int) -> float:
    """Milliseconds per generated token of one request alone, after its first token."""
    engine = llm.engine
    engine.add_request("single-stream", {"prompt_token_ids": prompt}, greedy(new_tokens))
    first: tuple[float, int] | None = None
    count = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            count = len(out.outputs[0].token_ids)
            if first is None and count:
                first = (time.perf_counter(), count)
    end = time.perf_counter()
    if first is None or count <= first[1]:
        raise RuntimeError("single stream: fewer than two tokens generated")
    return (end - first[0]) * 1e3 / (count - first[1])


def weight_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes a decode step must read: every weight, the embedding table aside unless it is
    also the LM head (a step reads one embedding row per token). Counted on a meta-device
    model of the shape, whatever the engine did to its own (packing, fusing)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, None)
    return sum(p.numel() * dtype.itemsize for name, p in model.named_parameters()
               if name != "embed_tokens.weight" or cfg.tie_word_embeddings)


def run_transformers(model_dir: Path, prompts: list[list[int]], new_tokens: int,
                     dtype: torch.dtype, device: torch.device, args: argparse.Namespace
                     ) -> tuple[float, list[list[int]], str]:
    """Seconds of one `generate_batch` call over the workload, each request's output ids and
    the attention implementation used; the same dummy weights as pdmesh's (same seed)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir)
    ours, cfg, _ = load_model(model_dir, dtype, device, config.max_position_embeddings,
                              load_format="dummy", seed=args.seed)
    state = hf_state_dict(ours)
    del ours
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"transformers model: missing {missing[:3]}, unexpected "
                           f"{unexpected[:3]}")
    del state
    model.eval()
    attn = set_attention(model, args.hf_attn)
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    extra: dict[str, Any] = {}
    if args.hf_num_blocks:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        extra["continuous_batching_config"] = ContinuousBatchingConfig(
            num_blocks=args.hf_num_blocks, max_batch_tokens=args.max_num_batched_tokens)
    warm = random_prompts(min(8, len(prompts)), (16, 64), args.seed + 2)
    model.generate_batch(warm, generation_config=gen, progress_bar=False, **extra)
    synchronize(device)
    start = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=gen, progress_bar=False, **extra)
    synchronize(device)
    seconds = time.perf_counter() - start
    by_prompt = {tuple(r.prompt_ids): list(r.generated_tokens) for r in results.values()}
    ids = [by_prompt[tuple(p)] for p in prompts]
    del model, results
    return seconds, ids, attn


def set_attention(model: Any, wanted: str | None) -> str:
    """`wanted`, else the name transformers gives SDPA over its paged cache: `paged|sdpa`
    before 5.23 (what issue 9 measured, with 5.17), plain `sdpa` from 5.23 on."""
    import transformers
    from packaging.version import Version

    if wanted is None:
        modern = Version(transformers.__version__) >= Version("5.23")
        wanted = "sdpa" if modern else "paged|sdpa"
    model.set_attn_implementation(wanted)
    return wanted


def free_device(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_shape(shape: str, workdir: Path, tokenizer_dir: Path, args: argparse.Namespace
                ) -> ShapeResult:
    model_dir = write_model_dir(shape, workdir / shape, tokenizer_dir)
    device = torch.device(args.device if args.device != "auto"
                          else ("cuda" if torch.cuda.is_available() else "cpu"))
    memory = ({"gpu_memory_utilization": args.gpu_memory_utilization} if device.type == "cuda"
              else {"kv_cache_memory": args.kv_cache_memory})
    llm = LLM(str(model_dir), load_format="dummy", dtype=args.dtype, device=str(device),
              seed=args.seed, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=max(256, args.decode_batch),
              attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
              async_scheduling=args.async_scheduling, **memory)
    dtype = EngineConfig(dtype=args.dtype).torch_dtype(device)
    weights = weight_bytes_per_token(llm.engine.model_config, dtype)
    result = ShapeResult(shape, device_name(device), str(dtype).removeprefix("torch."), weights)
    unit = "GPU" if device.type == "cuda" else "CPU"

    prompts = random_prompts(args.num_requests, tuple(args.input_len), args.seed)
    new = args.output_len
    # Warm-up on other prompts (no prefix-cache hits for the timed run): kernels compiled,
    # allocator and graphs ready for every batch size the workload reaches.
    warm = random_prompts(min(args.num_requests, 32), tuple(args.input_len), args.seed + 1)
    llm.generate([{"prompt_token_ids": p} for p in warm], greedy(8), use_tqdm=False)
    ours_s, ours_ids = run_pdmesh_workload(llm, prompts, new)
    out_tokens = args.num_requests * new

    step_prompts = random_prompts(args.decode_batch, tuple(args.input_len), args.seed + 3)
    wall_ms, kernel_ms, busy_pct, seen = decode_step(llm, step_prompts, args.decode_steps, device)
    if seen != args.decode_batch:
        result.notes.append(f"decode steps ran at batch {seen}, not {args.decode_batch} "
                            "(KV cache too small?)")
    single_prompt = random_prompts(1, (args.single_prompt, args.single_prompt), args.seed + 4)
    single_stream(llm, single_prompt[0], 8)  # warm-up
    single_ms = single_stream(llm, single_prompt[0], new)
    del llm
    free_device(device)

    hf_s: float | None = None
    if not args.skip_hf:
        hf_s, hf_ids, attn = run_transformers(model_dir, prompts, new, dtype, device, args)
        same = sum(a == b for a, b in zip(ours_ids, hf_ids, strict=True))
        result.notes.append(
            f"transformers generate_batch ({attn}): greedy output equal to pdmesh's on "
            f"{same}/{len(prompts)} requests (all expected in float32; bf16 drifts)")
        free_device(device)

    floor_ms = weights / args.hbm_bandwidth * 1e3
    b = args.decode_batch
    result.rows = [
        Row("pdmesh_s", "pdmesh LLM.generate: time s", ours_s),
        Row("pdmesh_tok_s", "pdmesh LLM.generate: output tok/s", out_tokens / ours_s),
        Row("hf_s", "transformers generate_batch: time s", hf_s),
        Row("hf_tok_s", "transformers generate_batch: output tok/s",
            out_tokens / hf_s if hf_s else None),
        Row("speedup", "pdmesh / transformers", hf_s / ours_s if hf_s else None, "{:.2f}x"),
        Row("step_wall_ms", f"decode step, batch {b}: wall ms", wall_ms, "{:.2f}"),
        Row("step_kernel_ms", f"decode step, batch {b}: "
            + ("GPU kernel ms (torch.profiler)" if unit == "GPU"
               else "CPU op ms under torch.profiler (no GPU)"), kernel_ms, "{:.2f}"),
        Row("step_busy_pct", f"decode step, batch {b}: {unit} busy %", busy_pct),
        Row("single_ms_per_token", f"single stream ({args.single_prompt} in, {new} new): "
            "ms/token", single_ms, "{:.2f}"),
        Row("single_tok_s", "single stream: tok/s", 1e3 / single_ms),
        Row("floor_ms_per_token", f"weight-read floor ms/token ({weights / 1e9:.2f} GB / "
            f"{args.hbm_bandwidth / 1e12:.2f} TB/s)", floor_ms, "{:.3f}"),
        Row("single_over_floor", "single stream / floor", single_ms / floor_ms, "{:.1f}x"),
    ]
    return result


# -- output -----------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def git_revision() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=Path(__file__).parent, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def provenance(args: argparse.Namespace) -> dict[str, str]:
    import transformers

    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "tree": git_revision(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "workload": (f"{args.num_requests} requests, prompts {args.input_len[0]}-"
                     f"{args.input_len[1]} random ids (seed {args.seed}), {args.output_len} "
                     "new tokens each, greedy, ignore_eos"),
    }


def print_tables(prov: dict[str, str], results: list[ShapeResult]) -> None:
    print(f"{prov['date']}, tree {prov['tree']}, torch {prov['torch']}, "
          f"transformers {prov['transformers']}")
    print(f"workload: {prov['workload']}")
    for r in results:
        print(f"\n{r.shape}: {r.dtype} on {r.device}, {r.weight_bytes / 1e9:.2f} GB of weights "
              "read per decode step")
        width = max(len(row.label) for row in r.rows)
        print(f"| {'measure':<{width}} | {'value':>9} |")
        print(f"|{'-' * (width + 2)}|{'-' * 10}:|")
        for row in r.rows:
            print(f"| {row.label:<{width}} | {row.text():>9} |")
        for note in r.notes:
            print(f"note: {note}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3-8b,llama3.2-1b",
                    help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a directory with SmolLM2's tokenizer files (default: the smollm2 "
                         "model directory)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where the model directories are written (default: a temporary one)")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--input-len", type=int, nargs=2, default=(128, 1024))
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--decode-batch", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=10)
    ap.add_argument("--single-prompt", type=int, default=512)
    ap.add_argument("--hbm-bandwidth", type=float, default=3.35e12,
                    help="bytes/s of device memory for the floor (H100 SXM: 3.35e12)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="default: the engine's (on for CUDA)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-cache-memory", default="512MiB", help="CPU only")
    ap.add_argument("--hf-attn", default=None, help="default: paged|sdpa, else sdpa")
    ap.add_argument("--hf-num-blocks", type=int, default=None,
                    help="transformers' KV blocks (default: its own sizing from free memory)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every shape, print the tables; returns what `--json` writes."""
    import tempfile

    args = parse_args(argv)
    tokenizer_dir = args.tokenizer or default_tokenizer_dir()
    prov = provenance(args)
    results = []
    with tempfile.TemporaryDirectory(prefix="pdmesh-gpu-bench-") as tmp:
        workdir = args.workdir or Path(tmp)
        for shape in args.shapes.split(","):
            results.append(bench_shape(shape, workdir, tokenizer_dir, args))
    print_tables(prov, results)
    report = {"provenance": prov, "hbm_bandwidth": args.hbm_bandwidth,
              "shapes": {r.shape: {**{k: v for k, v in asdict(r).items() if k != "rows"},
                                   **{row.key: row.value for row in r.rows}}
                         for r in results}}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
