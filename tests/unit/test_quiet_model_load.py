"""Loading a model on a CPU-only host imports neither torch._dynamo nor triton.

Triton cannot run on a CPU device, and once imported its nanobind bindings print ~60 lines of
"nanobind: leaked N instances" at every exit of the engine core, burying the real error of a
failed `pdmesh serve` start. It came in through `normal_` on the meta-device model skeleton
(torch._dynamo, then triton), which also cost every core 1.7 s of start-up.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdmesh.engine.worker.model_loader import load_model
from tests.unit.test_dummy_load import write_config

PROBE = """
import sys
from pathlib import Path
import torch
from pdmesh.engine.worker.model_loader import load_model
load_model(Path(sys.argv[1]), torch.float32, torch.device("cpu"), 128, load_format="dummy")
print(sorted(m for m in ("torch._dynamo", "triton") if m in sys.modules))
"""


@pytest.mark.processes
@pytest.mark.slow
def test_a_cpu_model_load_imports_no_triton(tmp_path: Path) -> None:
    model_dir = write_config(tmp_path / "m")
    proc = subprocess.run([sys.executable, "-c", PROBE, str(model_dir)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


@pytest.mark.fast
def test_the_skipped_initializer_is_restored(tmp_path: Path) -> None:
    normal = torch.nn.init.normal_
    load_model(write_config(tmp_path / "m"), torch.float32, torch.device("cpu"), 128,
               load_format="dummy")
    assert torch.nn.init.normal_ is normal
