"""The engine core's CPU threads: how many torch uses, and how they wait.

torch starts one OpenMP thread per CPU, and GNU OpenMP threads spin for a while (300,000
spins) after each parallel region before they sleep. A core alone on a machine wants that. A
core in a serving mesh shares the host with its serving process (gRPC, detokenizing, KV
transfers), the router (tokenizing) and often other engines: once more threads spin than
there are CPUs, every op waits for threads that are not running. Measured on 2 CPUs, a
colocated mesh, a 2-token request beside one big prompt being tokenized:

| core threads, spin | the request alone | beside the tokenizing |
|---|---|---|
| 2, libgomp default | 0.10 s | 1.1-1.9 s |
| 1 | 0.14 s | 0.17 s |
| 2, GOMP_SPINCOUNT=1000 | 0.15 s | 0.20 s |
| 2, GOMP_SPINCOUNT=10000 | | 0.32-0.37 s |
| 2, GOMP_SPINCOUNT=30000 | | 0.47-0.70 s |

A spin must still cover the gaps between one step's parallel regions (a GEMM, then some
Python, then the next GEMM): once the engine's other work got fast, at vLLM `bench serve`
concurrency 16 a 1000-spin core lost 13 % of its throughput to waking its threads (81.4 vs
94.1 out tok/s with 10,000 spins, TPOT p50 at 1 req/s 114 vs 84 ms), and 30,000 spins gained
another 10 % but let one tokenizing prompt hold up a small request as long as tokenizing it.
One thread loses a third of the throughput. 10,000 spins (~0.3 ms) is the balance. So a core
process gets, unless told otherwise (`--cpu-threads`, OMP_NUM_THREADS, GOMP_SPINCOUNT /
OMP_WAIT_POLICY):
- on a CPU device every CPU it may run on, with a short spin;
- on CUDA one thread: the device computes, the host prepares small inputs, and every engine
  of a multi-GPU node would otherwise start one thread per CPU (vLLM's workers do the same).

A tensor-parallel engine splits its threads over its ranks (`rank_threads`): the host runs as
many as one rank would, and each rank's GEMMs are that much smaller.

`core_environment` is the one place a core process's environment is made (the spin above, and
how NCCL treats a failed group: read at start-up, so set before the process runs).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SHORT_SPIN = "10000"
"""GOMP_SPINCOUNT for a core process: spin a fraction of a millisecond, then sleep."""


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: cgroup cpusets, taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def core_threads(configured: int | None, device_type: str, cpus: int,
                 environ: Mapping[str, str] | None = None) -> int | None:
    """The thread count a core process sets, or None to leave torch's own (the user set
    OMP_NUM_THREADS, which torch has read already)."""
    if configured is not None:
        return configured
    env = os.environ if environ is None else environ
    if env.get("OMP_NUM_THREADS"):
        return None
    return 1 if device_type == "cuda" else max(1, cpus)


NCCL_ABORT_ONLY = "2"
"""TORCH_NCCL_ASYNC_ERROR_HANDLING: a failed or timed-out NCCL group has its communicator
aborted, and the process lives. torch's default (3) tears the process down: a KV pull over
NCCL whose sender died (`kvstore/connector/dist_blocks.py`, a group per pair of cores) would
kill the pulling engine core, where the pull should fail and its request recompute."""


def core_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a core process starts with: `environ` and a short OpenMP spin, unless
    the user chose how threads wait (read by libgomp when it loads: it must be set here), and
    NCCL's error handling that keeps the process (`NCCL_ABORT_ONLY`) unless the user chose
    one (read when a group is made, so set before any thread runs)."""
    env = dict(environ)
    if not env.get("GOMP_SPINCOUNT") and not env.get("OMP_WAIT_POLICY"):
        env["GOMP_SPINCOUNT"] = SHORT_SPIN
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ABORT_ONLY)
    return env


def rank_threads(total: int | None, device_type: str, fallback: int, world_size: int
                 ) -> int | None:
    """The torch threads of each rank of a tensor-parallel engine: the engine's threads
    (`total`, else `fallback`: torch's own count) split evenly over its ranks, so the host
    runs as many as one engine of the same config would; 1 each on CUDA. A single rank
    keeps `total`."""
    if world_size == 1:
        return total
    if device_type == "cuda":
        return total or 1
    return max(1, (total or fallback) // world_size)
