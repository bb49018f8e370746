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

and at vLLM `bench serve` concurrency 16 the short spin kept the throughput (78.0 vs 78.5 out
tok/s) where one thread lost a third of it (56.4). So a core process gets, unless told
otherwise (`--cpu-threads`, OMP_NUM_THREADS, GOMP_SPINCOUNT / OMP_WAIT_POLICY):
- on a CPU device every CPU it may run on, with a short spin;
- on CUDA one thread: the device computes, the host prepares small inputs, and every engine
  of a multi-GPU node would otherwise start one thread per CPU (vLLM's workers do the same).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SHORT_SPIN = "1000"
"""GOMP_SPINCOUNT for a core process: spin ~microseconds, then sleep."""


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


def core_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a core process starts with: `environ` and a short OpenMP spin, unless
    the user chose how threads wait (read by libgomp when it loads: it must be set here)."""
    env = dict(environ)
    if not env.get("GOMP_SPINCOUNT") and not env.get("OMP_WAIT_POLICY"):
        env["GOMP_SPINCOUNT"] = SHORT_SPIN
    return env
