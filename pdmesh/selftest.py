"""`pdmesh selftest`: what an operator runs on a new node before serving from it.

The engine core's start-up checks (engine/worker/selfcheck.py) on this machine's device —
on CUDA the Triton layer ops and attention, graph replay, async scheduling and on-device
sampling; on a CPU the native kernels (kernels/cpu_native.py, cpu_attention.py, layer_ops.py)
against the torch reference and the sampler — then a greedy parity run: an engine core on
random weights of a config's shape against transformers' Llama on the same weights, float32,
a handful of prompts, their token ids compared; then every KV transport (shm or CUDA IPC,
tcp, torch_dist, ucxx) moving blocks from a cache on the device to a receiving core in
another process, on the second GPU where there is one (kvstore/connector/selfcheck.py).
Prints one table; exits 0 when nothing failed, 1 otherwise.

    pdmesh selftest                          # a small Llama shape on the default device
    pdmesh selftest --model meta-llama/Llama-3.2-1B --device cuda   # that config's shape

Only the config is read (`--model`: a directory with config.json, an alias or a Hub id):
the weights are random, so nothing large is downloaded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.worker.selfcheck import CheckResult, run_selfcheck

DEFAULT_SHAPE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 640,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}
"""A small Llama (GQA 8:2, head_dim 32): seconds on a CPU, every code path of a real one."""

PROMPT_LENGTHS = (3, 16, 37, 100)


def write_config_dir(model: str | None, dest: Path) -> Path:
    """`dest` holding only the config.json of `model` (or of the default small shape)."""
    dest.mkdir(parents=True, exist_ok=True)
    if model is None:
        (dest / "config.json").write_text(json.dumps(DEFAULT_SHAPE, indent=2))
        return dest
    from pdmesh.engine.model_store import resolve_model

    source = resolve_model(model, "dummy")
    shutil.copy(source / "config.json", dest / "config.json")
    return dest


def prompts_for(vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def transformers_greedy(model_dir: Path, ours: torch.nn.Module, prompts: list[list[int]],
                        new_tokens: int, device: torch.device) -> list[list[int]]:
    """transformers' Llama on our weights (`hf_state_dict`: the same tensors, split back into
    its names), greedy, never stopping early."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from pdmesh.engine.worker.checkpoint_names import hf_state_dict

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(hf_state_dict(ours), strict=False, assign=True)
    if config.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"weights: missing {missing[:3]}, unexpected {unexpected[:3]}")
    hf.eval()
    gen = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def engine_greedy(config: EngineConfig, prompts: list[list[int]], new_tokens: int
                  ) -> tuple[list[list[int]], str]:
    """An engine core's greedy ids for `prompts`, all in flight together, and its own
    start-up self-check's summary."""
    from pdmesh.engine.core.engine_core import EngineCore
    from pdmesh.engine.engine_request import EngineRequest
    from pdmesh.engine.sampling_params import SamplingParams

    core = EngineCore(config, eos_token_ids=())
    try:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            core.add(EngineRequest(f"selftest-{i}", list(prompt), params))
        tokens: dict[str, list[int]] = {f"selftest-{i}": [] for i in range(len(prompts))}
        while core.has_unfinished_requests():
            for out in core.step():
                for sample in out.samples:
                    tokens[out.request_id] += sample.new_token_ids
        return [tokens[f"selftest-{i}"] for i in range(len(prompts))], core.info().selfcheck
    finally:
        core.close()


def parity(config: EngineConfig, model_dir: Path, new_tokens: int) -> list[CheckResult]:
    """The engine's greedy ids against transformers' on the same random weights, and the
    engine core's own start-up self-check as it reported it."""
    from pdmesh.engine.core.startup import model_max_positions
    from pdmesh.engine.worker.model_loader import load_model

    device = config.torch_device()
    started = time.perf_counter()
    ours, cfg, _ = load_model(model_dir, torch.float32, device,
                              model_max_positions(model_dir, None), load_format="dummy",
                              seed=config.seed)
    prompts = prompts_for(cfg.vocab_size)
    expected = transformers_greedy(model_dir, ours, prompts, new_tokens, device)
    del ours
    got, startup = engine_greedy(config, prompts, new_tokens)
    seconds = time.perf_counter() - started
    equal = sum(a == b for a, b in zip(got, expected, strict=True))
    detail = f"{equal}/{len(prompts)} prompts, {new_tokens} tokens each, equal"
    outcome = "pass" if equal == len(prompts) else "fail"
    if outcome == "fail":
        first = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
        detail += f"; prompt {first}: {got[first]} vs transformers {expected[first]}"
    startup_outcome = ("skip" if startup.startswith("not run")
                       else "fail" if startup.startswith("FAILED") else "pass")
    return [CheckResult("parity vs transformers", str(device), outcome, detail, seconds),
            CheckResult("engine start-up self-check", str(device), startup_outcome, startup)]


def format_table(results: list[CheckResult]) -> str:
    rows = [("check", "device", "result", "time")]
    for r in results:
        result = r.outcome if not r.detail else f"{r.outcome}: {r.detail}"
        rows.append((r.name, r.device, result, f"{r.seconds:.2f} s"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]

    def line(row: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(rows[0]), rule, *(line(row) for row in rows[1:])])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdmesh selftest", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="the shape to check: a directory with config.json, an alias or a Hub "
                         "id (its config only); default: a small Llama")
    ap.add_argument("--device", default="auto", help="auto|cpu|cuda[:N]")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--skip-kv", action="store_true",
                    help="skip the KV transports (blocks pulled by a second process)")
    args = ap.parse_args(argv)
    # float32 parity needs exact float32 GEMMs: TF32 would differ from the CPU-exact reference.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory(prefix="pdmesh-selftest-") as tmp:
        model_dir = write_config_dir(args.model, Path(tmp) / "model")
        config = EngineConfig(model=str(model_dir), load_format="dummy", dtype="float32",
                              device=args.device, attention_backend=args.attention_backend,
                              kv_cache_memory=args.kv_cache_memory, max_num_seqs=8)
        device = config.torch_device()
        results = selfcheck_rows(config, model_dir, device)
        results += parity(config, model_dir, args.max_tokens)
        if not args.skip_kv:
            results += kv_rows(device)
    print(format_table(results))
    failed = [r.name for r in results if r.failed]
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}")
    return 1 if failed else 0


def selfcheck_rows(config: EngineConfig, model_dir: Path, device: torch.device
                   ) -> list[CheckResult]:
    """The engine's start-up checks on a float32 model of the shape and, on CUDA, on one in
    bfloat16 too (the dtype it serves in by default); a row both runs share (the float32
    kernels, the sampler) is shown once."""
    from pdmesh.engine.core.startup import model_max_positions
    from pdmesh.engine.worker.model_loader import load_model

    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    results: dict[str, CheckResult] = {}
    for dtype in dtypes:
        model, _, _ = load_model(model_dir, dtype, device, model_max_positions(model_dir, None),
                                 load_format="dummy", seed=config.seed)
        for r in run_selfcheck(config, model, device).results:
            results.setdefault(r.name, r)
        del model
    return list(results.values())


def kv_rows(device: torch.device) -> list[CheckResult]:
    """Every KV transport moving blocks to a receiving core in another process, in a private
    directory of the shm directory the engines use (where the same-host caches live)."""
    from pdmesh.kvstore.connector.config import DEFAULT_SHM_DIR
    from pdmesh.kvstore.connector.selfcheck import check_transports

    with tempfile.TemporaryDirectory(prefix="pdmesh-selftest-kv-", dir=DEFAULT_SHM_DIR) as shm_dir:
        return check_transports(device, Path(shm_dir))


if __name__ == "__main__":
    sys.exit(main())
