"""bench/gpu_throughput.py runs end to end on CPU with the tiny shape and prints every row.

The same code runs unchanged on a lent GPU with the real shapes; this smoke run keeps it
working between the (rare) GPU sessions. transformers' continuous batching on the same dummy
weights must produce pdmesh's greedy tokens in float32, which checks the weight hand-over
(q/k/v and gate/up split back into transformers' names) as well.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_throughput.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("gpu_throughput", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.weights
@pytest.mark.slow
def test_tiny_shape_prints_every_row(tmp_path: Path, model_dir: Path, capsys) -> None:
    bench = load_bench()
    out_json = tmp_path / "result.json"
    report = bench.main([
        "--shapes", "tiny", "--tokenizer", str(model_dir), "--workdir", str(tmp_path),
        "--num-requests", "6", "--input-len", "16", "48", "--output-len", "12",
        "--decode-batch", "4", "--decode-steps", "3", "--single-prompt", "24",
        "--max-num-batched-tokens", "128", "--kv-cache-memory", "16MiB",
        "--hf-num-blocks", "32", "--json", str(out_json),
    ])
    printed = capsys.readouterr().out
    for label in (
        "pdmesh LLM.generate: output tok/s",
        "transformers generate_batch: output tok/s",
        "pdmesh / transformers",
        "decode step, batch 4: wall ms",
        "decode step, batch 4: CPU op ms under torch.profiler (no GPU)",
        "decode step, batch 4: CPU busy %",
        "single stream (24 in, 12 new): ms/token",
        "single stream: tok/s",
        "weight-read floor ms/token",
        "single stream / floor",
    ):
        assert label in printed, f"missing row {label!r} in:\n{printed}"
    assert "n/a" not in printed
    assert "greedy output equal to pdmesh's on 6/6 requests" in printed
    assert "decode steps ran at batch" not in printed  # the batch really was 4
    assert json.loads(out_json.read_text()) == json.loads(json.dumps(report))
    tiny = report["shapes"]["tiny"]
    assert tiny["pdmesh_tok_s"] > 0 and tiny["hf_tok_s"] > 0
    assert tiny["step_kernel_ms"] > 0 and tiny["step_wall_ms"] > 0
    assert 0 < tiny["step_busy_pct"] <= 100
    assert tiny["weight_bytes"] > 0 and tiny["floor_ms_per_token"] > 0


@pytest.mark.fast
def test_unknown_shape_is_refused() -> None:
    bench = load_bench()
    with pytest.raises(SystemExit):
        bench.parse_args(["--shapes", "llama3-8b,gpt5"])
