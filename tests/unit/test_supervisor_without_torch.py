"""`pdmesh serve`'s supervisor and the OpenAI gateway are CPU processes: neither imports torch.

The supervisor only parses the mesh's config, renders its children's flags and watches them;
torch in it cost ~250 MiB of RSS for as long as the mesh ran (bench/README.md, "RSS"). Checked
in a fresh interpreter (this test process has torch already): importing the command, parsing a
quickstart's flags and rendering every child's flags leave `torch` out of `sys.modules`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdmesh.devices import engines_use_cuda

NO_TORCH = """
import sys
import pdmesh.cli
from pdmesh.config import parse_config
from pdmesh.serve.command import _positional_model
from pdmesh.serve.config import MeshConfig
from pdmesh.serve.mesh import LocalMesh
import pdmesh.gateway.server

argv = ["smollm2", "--port", "0", "--kv-cache-memory", "512MiB", "--local-prefill-threshold", "0"]
config = parse_config(MeshConfig, _positional_model(argv), prog="pdmesh serve")
mesh = LocalMesh(config)
mesh.redis_url = "redis://127.0.0.1:1/0"
for kind in ("prefill", "decode", "colocated"):
    assert mesh.engine_args(kind)
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, loaded
"""


@pytest.mark.slow
@pytest.mark.processes
def test_the_supervisor_and_the_gateway_run_without_torch() -> None:
    done = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.fast
def test_an_explicit_device_needs_no_probe() -> None:
    assert engines_use_cuda("cpu") is False
    assert engines_use_cuda("cuda") is True
    assert engines_use_cuda("cuda:1") is True
