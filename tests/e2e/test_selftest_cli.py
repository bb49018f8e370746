"""`pdmesh selftest` on this (CPU) machine, as an operator runs it on a new node: the native CPU
kernels against the reference, the sampler, greedy parity with transformers on random
weights of the default small Llama shape, and every KV transport moving blocks to a second
process; a table, exit 0.

The pieces (table, config directory, prompts) are checked in-process below; the checks
themselves in tests/unit/test_selfcheck.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdmesh import selftest
from pdmesh.engine.worker.selfcheck import CheckResult


@pytest.mark.processes
@pytest.mark.slow
def test_selftest_passes_on_this_cpu_and_prints_its_table() -> None:
    proc = subprocess.run([sys.executable, "-m", "pdmesh.cli", "selftest", "--device", "cpu"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split("|")[1].strip(): line.split("|")[2:4]
            for line in proc.stdout.splitlines() if line.startswith("| ")}
    for check in ("layer_ops[float32]", "attention[float32]", "cuda_graphs[float32]",
                  "async_pending[float32]", "sampler", "parity vs transformers",
                  "engine start-up self-check"):
        assert check in rows, f"no row {check!r} in:\n{proc.stdout}"
        assert rows[check][0].strip() == "cpu", rows[check]
    result = {name: cells[1].strip() for name, cells in rows.items()}
    assert result["layer_ops[float32]"] == "pass"
    assert result["attention[float32]"] == "pass"
    assert result["sampler"] == "pass"
    assert result["parity vs transformers"].startswith("pass: 4/4 prompts, 16 tokens each")
    assert result["cuda_graphs[float32]"].startswith("skip")  # none on a CPU
    for backend in ("shm", "tcp", "torch_dist"):  # blocks pulled by a second process
        assert result[f"kv transfer {backend}"].startswith("pass: 6 blocks"), proc.stdout
    assert result["kv transfer ucxx"].startswith(("pass: 6 blocks", "skip")), proc.stdout
    assert "all checks passed" in proc.stdout


@pytest.mark.fast
def test_the_table_has_a_row_per_check_and_a_failure_says_why() -> None:
    table = selftest.format_table([
        CheckResult("sampler", "cuda:0", "pass", seconds=0.25),
        CheckResult("attention[bfloat16]", "cuda:0", "fail", "decode rows: max error 1",
                    1.5),
    ])
    lines = table.splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:5]] == ["check", "device", "result",
                                                             "time"]
    cells = [[c.strip() for c in line.split("|")[1:5]] for line in lines[2:]]
    assert cells == [["sampler", "cuda:0", "pass", "0.25 s"],
                     ["attention[bfloat16]", "cuda:0", "fail: decode rows: max error 1",
                      "1.50 s"]]
    assert len({len(line) for line in lines}) == 1  # aligned


@pytest.mark.fast
def test_the_default_shape_is_a_small_llama_written_alone(tmp_path: Path) -> None:
    model_dir = selftest.write_config_dir(None, tmp_path / "m")
    assert [p.name for p in model_dir.iterdir()] == ["config.json"]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 2
    prompts = selftest.prompts_for(config["vocab_size"])
    assert [len(p) for p in prompts] == list(selftest.PROMPT_LENGTHS)
    assert prompts == selftest.prompts_for(config["vocab_size"])  # seeded
