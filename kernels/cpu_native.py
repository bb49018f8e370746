"""Native CPU kernels: C compiled on first use, called through ctypes.

vLLM's CPU backend ships C++ attention kernels; we build ours on the machine that runs them
(`cc -O3 -march=native -fopenmp`, well under a second) and keep the library in the user's
cache, keyed by the source, the compiler and the CPU. Linked with -fopenmp, the library uses
the OpenMP runtime torch already loaded (the same `libgomp.so.1`), so it runs on torch's
threads. No compiler, a failed build, or PDMESH_CPU_KERNELS=0: `library()` is None and the
callers keep their torch path.

Nothing is unpickled or taken from outside: the source is this package's own file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention_cpu.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
DISABLE_ENV = "PDMESH_CPU_KERNELS"

_lock = threading.Lock()


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "pdmesh" / "kernels"


def _cpu_identity() -> str:
    """The CPU's model and flags: -march=native code must not run on another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    key = hashlib.sha256(
        b"\0".join(x.encode() for x in (SOURCE.read_text(), version, " ".join(CFLAGS),
                                         platform.machine(), _cpu_identity()))
    ).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention_cpu-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", str(built), "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: concurrent builders agree on one file
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be built (the callers fall back)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None or platform.system() != "Linux":
        logger.info("native CPU kernels: no C compiler; using the torch path")
        return None
    with _lock:
        try:
            path = _build(compiler)
            lib = ctypes.CDLL(str(path))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            logger.warning("native CPU kernels unavailable, using the torch path: %s", exc)
            return None
    fn = lib.pdmesh_paged_decode_attention_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_float]
    logger.info("native CPU kernels: %s", path)
    return lib


def supports(query: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """Whether `paged_decode_attention` can take these tensors."""
    return (query.device.type == "cpu" and kv_layer.device.type == "cpu"
            and query.dtype == torch.float32 and kv_layer.dtype == torch.float32
            and kv_layer.is_contiguous() and library() is not None)


def paged_decode_attention(query: torch.Tensor, kv_layer: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Decode rows `query[B, Hq, D]` against their paged context (float32, CPU): the same
    result as `torch_ref.paged_decode_attention` up to float32 summation order."""
    lib = library()
    assert lib is not None, "check supports() first"
    batch, num_q_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, kv_dim = kv_layer.shape
    if kv_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"attention: query {tuple(query.shape)} does not fit KV "
                         f"{tuple(kv_layer.shape)}")
    q = query.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    if tables.shape[0] != batch or lens.shape != (batch,):
        raise ValueError("attention: block tables / lengths do not match the batch")
    out = torch.empty_like(q)
    code = lib.pdmesh_paged_decode_attention_f32(
        q.data_ptr(), kv_layer.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
        batch, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks, tables.shape[1],
        scale)
    if code != 0:
        raise RuntimeError(f"native paged attention failed (code {code}: 1 bad shape, 2 out "
                           "of memory, 3 a block id outside the cache)")
    return out
