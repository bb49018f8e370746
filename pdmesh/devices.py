"""Whether engines will run on CUDA, answered without importing torch.

Two processes need the answer but not torch, which would cost each ~250 MiB of RSS for as long
as it runs: `pdmesh serve`'s supervisor (a CPU host's engines share its CPUs, serve/mesh.py)
and an engine service choosing the KV planes it offers (engine_svc/process.py: UCX only
where it has more than TCP to use). A host without an NVIDIA device node cannot run CUDA, so
it is answered at once; only where one exists does a short-lived interpreter ask torch, whose
memory goes with it.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from functools import cache

_PROBE = "import torch; print(int(torch.cuda.is_available()))"
PROBE_TIMEOUT_S = 60.0


def engines_use_cuda(device: str) -> bool:
    """Whether engines started with `--device device` (auto|cpu|cuda[:N]) run on CUDA."""
    if device == "cpu":
        return False
    if device.startswith("cuda"):
        return True
    return cuda_available()


@cache
def cuda_available() -> bool:
    """torch.cuda.is_available(), as the engines (this interpreter, this environment) see it."""
    if not (glob.glob("/dev/nvidia[0-9]*") or os.path.isdir("/proc/driver/nvidia/gpus")):
        return False
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.strip() == "1"
