"""engine/core/host_allocator.py: the user's own malloc settings win, and once the thresholds are
fixed a megabyte-sized temporary allocated and freed every step stops faulting its pages in
anew (each case in a fresh interpreter: the thresholds are process-wide)."""

from __future__ import annotations

import platform
import subprocess
import sys
from statistics import median

import pytest

from pdmesh.engine.core.host_allocator import wants_tuning

CHURN = """
import resource, sys
import torch
from pdmesh.engine.core.host_allocator import keep_temporaries_on_heap
if sys.argv[1] == "tuned":
    assert keep_temporaries_on_heap()
def step():  # what a step does to its logits-sized temporaries: make, use, free
    a = torch.ones(16, 49152, dtype=torch.float64)
    b = a.cumsum(dim=-1)
    return float(b[0, -1])
faults = []
for _ in range(30):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(" ".join(map(str, faults)))
"""


@pytest.mark.fast
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


def faults_per_step(mode: str) -> list[int]:
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "MALLOC_MMAP_THRESHOLD_": "", "MALLOC_TRIM_THRESHOLD_": ""}
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True,
                         timeout=120, check=True, env=env)
    return [int(n) for n in out.stdout.strip().splitlines()[-1].split()]


@pytest.mark.processes
@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="glibc's mallopt")
def test_fixed_thresholds_stop_page_faults_on_reused_temporaries() -> None:
    # Two 6 MiB temporaries a step: with glibc's starting thresholds each is a fresh mapping
    # (~3,000 faults every step); kept on the heap they are reused, so a step in the steady
    # state faults nothing. The heap reaches its high-water mark over the first steps (1 to 8
    # of them, depending on where address-space randomization put it), so the steady state is
    # the median step, not the mean of a window that may still hold that growth.
    default, tuned = faults_per_step("default"), faults_per_step("tuned")
    assert median(default) > 1000, default
    assert median(tuned) < median(default) / 10, tuned
