"""Whether each KV data plane can be used in this process, answered without importing torch.

The backend modules build tensors (they import torch); an engine service whose core moves KV
itself must not load torch just to learn which planes exist (~240 MiB of RSS for as long as it
serves, bench/README.md "RSS"). `torch_dist` is the one question only torch answers: asked
directly where torch is loaded already, else by a short-lived interpreter (once per process),
whose memory goes with it.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import subprocess
import sys
from functools import cache

_DIST_PROBE = ("import torch.distributed as d; "
               "print(int(d.is_available() and d.is_gloo_available()))")
PROBE_TIMEOUT_S = 120.0


def shm_unavailable_reason() -> str | None:
    return None if hasattr(mmap, "MAP_POPULATE") else "needs Linux mmap (MAP_POPULATE)"


def tcp_unavailable_reason() -> str | None:
    return None


@cache
def ucxx_unavailable_reason() -> str | None:
    if importlib.util.find_spec("ucxx") is None:
        return "the 'ucxx' package (ucxx-cu12/ucxx-cu13) is not installed"
    try:
        import ucxx  # noqa: F401 - only checks that the native libraries load
    except Exception as exc:  # a broken native install should disable, not crash
        return f"importing ucxx failed: {exc}"
    return None


def ucx_tcp_only(uses_cuda: bool) -> bool:
    """Whether UCX would move KV over TCP alone here: no CUDA buffers and no transports chosen
    by the operator (`UCX_TLS`), where `ucx.py` restricts it to tcp,self,sm. It is then slower
    than the core's own tcp plane while its progress thread wakes ~900 times a second even
    idle, taking CPUs from the engine core (bench/README.md, "An idle UCX listener"): `auto`
    does not offer it there (engine_svc/process.py); `--kv-backend ucxx` still does."""
    return not uses_cuda and "UCX_TLS" not in os.environ


def torch_dist_unavailable_reason() -> str | None:
    """None when torch.distributed with gloo is built in (what both torch_dist ends need)."""
    if sys.modules.get("torch") is not None:
        return _dist_reason_here()
    return _dist_reason_probed()


def dist_available() -> bool:
    """torch.distributed with gloo is usable (the engine core's `dist_blocks.available`)."""
    return torch_dist_unavailable_reason() is None


def _dist_reason_here() -> str | None:
    import torch

    if not torch.distributed.is_available():
        return "torch.distributed is not built in"
    if not torch.distributed.is_gloo_available():
        return "torch.distributed has no gloo backend"
    return None


@cache
def _dist_reason_probed() -> str | None:
    try:
        done = subprocess.run([sys.executable, "-c", _DIST_PROBE], capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"could not ask torch whether torch.distributed has gloo: {exc}"
    if done.returncode != 0:
        return f"importing torch.distributed failed: {done.stderr.strip()[-300:]}"
    if done.stdout.strip() != "1":
        return "torch.distributed has no gloo backend"
    return None


REASONS = {
    "shm": shm_unavailable_reason,
    "tcp": tcp_unavailable_reason,
    "ucxx": ucxx_unavailable_reason,
    "torch_dist": torch_dist_unavailable_reason,
}
"""Each backend's check, by name; a backend module's `unavailable_reason` is the same."""
