"""engine/host_allocator.py: the user's own malloc settings win, and once the thresholds are
fixed a megabyte-sized temporary allocated and freed every step stops faulting its pages in
anew (each case in a fresh interpreter: the thresholds are process-wide)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from pdmesh.engine.host_allocator import wants_tuning

CHURN = """
import resource, sys
import torch
from pdmesh.engine.host_allocator import keep_temporaries_on_heap
if sys.argv[1] == "tuned":
    assert keep_temporaries_on_heap()
def step():  # what a step does to its logits-sized temporaries: make, use, free
    a = torch.ones(16, 49152, dtype=torch.float64)
    b = a.cumsum(dim=-1)
    return float(b[0, -1])
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


@pytest.mark.parametrize(("environ", "want"), [
    ({}, True),
    ({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"}, True),
    ({"PDMESH_HOST_ALLOCATOR": "default"}, False),
    ({"MALLOC_MMAP_THRESHOLD_": "1048576"}, False),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, False),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, False),
])
def test_the_users_malloc_settings_win(environ: dict[str, str], want: bool) -> None:
    assert wants_tuning(environ) is want


def faults_per_step(mode: str) -> float:
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "MALLOC_MMAP_THRESHOLD_": "", "MALLOC_TRIM_THRESHOLD_": ""}
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True,
                         timeout=120, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="glibc's mallopt")
def test_fixed_thresholds_stop_page_faults_on_reused_temporaries() -> None:
    # Two 6 MiB temporaries a step: with glibc's starting thresholds each is a fresh mapping
    # (~3,000 faults a step); kept on the heap they are reused (0 to ~80: the interpreter's
    # own pages).
    default, tuned = faults_per_step("default"), faults_per_step("tuned")
    assert default > 1000
    assert tuned < default / 10
