"""Native CPU kernels: C compiled on first use, called through ctypes.

vLLM's CPU backend ships C++ attention kernels; we build ours on the machine that runs them
(`cc -O3 -march=native -fopenmp`, well under a second) and keep the library in the user's
cache, keyed by the source, the compiler and the CPU. Linked with -fopenmp, the library uses
the OpenMP runtime torch already loaded (the same `libgomp.so.1`), so it runs on torch's
threads (the KV block routines excepted: they start short-lived pthreads, `kv_blocks_cpu.c`).

Where there is no compiler (the container image), libraries built ahead of time for the
x86-64 micro-architecture levels v4 and v3 (`python -m pdmesh.kernels.cpu_native prebuild`,
run by the image's build stage) sit in `prebuilt/`, named by level and by a hash of the
sources: the newest level this CPU's flags allow is loaded, and a library of other sources
never is. No compiler and no fitting prebuilt library, a failed build, or
PDMESH_CPU_KERNELS=0: `library()` is None and the callers keep their torch path
(PDMESH_CPU_KERNELS=prebuilt skips the compiler and takes only a prebuilt library).

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
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "paged_attention_cpu.c", CSRC / "layer_ops_cpu.c", CSRC / "kv_blocks_cpu.c",
           CSRC / "linear_cpu.c")
# What a library is built from: the sources and the headers they include.
BUILD_INPUTS = (*SOURCES, *(CSRC / h for h in ("exp_f32.h", "bf16.h", "paged_attention_body.h",
                                               "layer_ops_body.h")))
BASE_CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
DISABLE_ENV = "PDMESH_CPU_KERNELS"
PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"

ISA_LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("x86-64-v4", frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})),
    ("x86-64-v3", frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe",
                             "xsave"})),
    ("x86-64-v2", frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})),
)
"""The x86-64 psABI levels a library is prebuilt for, newest first, with the /proc/cpuinfo
flags each adds to the one below it (a level needs its own and every lower level's)."""
PREBUILT_LEVELS = ("x86-64-v4", "x86-64-v3")

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


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def fitting_levels(flags: frozenset[str]) -> list[str]:
    """The ISA levels a CPU with these flags runs, newest first."""
    fits: list[str] = []
    for i, (level, _) in enumerate(ISA_LEVELS):
        if all(needed <= flags for _, needed in ISA_LEVELS[i:]):
            fits.append(level)
    return fits


def _source_key() -> str:
    return hashlib.sha256(b"\0".join(src.read_bytes() for src in BUILD_INPUTS)).hexdigest()[:16]


def prebuilt_name(level: str) -> str:
    return f"pdmesh_cpu_kernels-{level}-{_source_key()}.so"


def _prebuilt(directory: Path | None = None) -> Path | None:
    """The prebuilt library of these sources for the newest level this CPU runs, if any."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    directory = directory or PREBUILT_DIR
    for level in fitting_levels(_cpu_flags()):
        path = directory / prebuilt_name(level)
        if path.is_file():
            return path
    return None


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    """Compile the sources into `target`, atomically (concurrent builders agree on one)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(built), "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)


def prebuild(out_dir: Path, levels: tuple[str, ...] = PREBUILT_LEVELS) -> list[Path]:
    """Build a library per ISA level into `out_dir` (the image's build stage runs this), for
    machines that have no compiler."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("prebuild: no C compiler (set CC or install gcc)")
    known = {level for level, _ in ISA_LEVELS}
    built = []
    for level in levels:
        if level not in known:
            raise ValueError(f"prebuild: unknown level {level!r}; known: {sorted(known)}")
        target = out_dir / prebuilt_name(level)
        _compile(compiler, (*BASE_CFLAGS, f"-march={level}", "-mtune=generic"), target)
        built.append(target)
    return built


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    key = hashlib.sha256(
        b"\0".join(x.encode() for x in (*(src.read_text() for src in BUILD_INPUTS), version,
                                         " ".join(CFLAGS), platform.machine(),
                                         _cpu_identity()))
    ).hexdigest()[:16]
    target = _cache_dir() / f"pdmesh_cpu_kernels-{key}.so"
    if not target.is_file():
        _compile(compiler, CFLAGS, target)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be built (the callers fall back)."""
    mode = os.environ.get(DISABLE_ENV, "1")
    if mode == "0" or platform.system() != "Linux":
        return None
    with _lock:
        lib = None
        compiler = None if mode == "prebuilt" else _compiler()
        if compiler is not None:
            try:
                path = _build(compiler)
                lib = ctypes.CDLL(str(path))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                logger.warning("native CPU kernels: the build failed (%s); trying a prebuilt "
                               "library", exc)
        if lib is None:
            found = _prebuilt()
            if found is None:
                logger.info("native CPU kernels: no compiler and no prebuilt library for this "
                            "CPU; using the torch path")
                return None
            try:
                path, lib = found, ctypes.CDLL(str(found))
            except OSError as exc:
                logger.warning("native CPU kernels unavailable, using the torch path: %s", exc)
                return None
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    for name, argtypes in (
        ("pdmesh_paged_decode_attention_f32", [ptr] * 5 + [i64] * 8 + [f32]),
        ("pdmesh_reshape_and_cache_f32", [ptr] * 4 + [i64] * 5),
        ("pdmesh_paged_decode_attention_bf16", [ptr] * 5 + [i64] * 8 + [f32]),
        ("pdmesh_reshape_and_cache_bf16", [ptr] * 4 + [i64] * 5),
        ("pdmesh_rms_norm_f32", [ptr] * 3 + [i64] * 2 + [f32]),
        ("pdmesh_add_rms_norm_f32", [ptr] * 4 + [i64] * 2 + [f32]),
        ("pdmesh_silu_and_mul_f32", [ptr] * 2 + [i64] * 2),
        ("pdmesh_rope_f32", [ptr] * 4 + [i64] * 6),
        ("pdmesh_rms_norm_bf16", [ptr] * 3 + [i64] * 2 + [f32]),
        ("pdmesh_add_rms_norm_bf16", [ptr] * 4 + [i64] * 2 + [f32]),
        ("pdmesh_silu_and_mul_bf16", [ptr] * 2 + [i64] * 2),
        ("pdmesh_rope_bf16", [ptr] * 4 + [i64] * 6),
        ("pdmesh_linear_pack_f32", [ptr] * 2 + [i64] * 2),
        ("pdmesh_linear_f32", [ptr] * 3 + [i64] * 3),
        ("pdmesh_kv_blocks_xxh64", [ptr] + [i64] * 3 + [ptr, i64, ptr, i64]),
        ("pdmesh_kv_copy_blocks_xxh64", [ptr, i64, ptr] + [i64] * 3 + [ptr, ptr, i64, ptr, i64]),
    ):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    logger.info("native CPU kernels: %s", path)
    return lib


# The dtypes the attention, cache-write and layer-op kernels are built for, and the suffix of
# their names (csrc/*_body.h, included once per type).
NATIVE_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _kernel(lib: ctypes.CDLL, name: str, dtype: torch.dtype) -> Callable[..., int]:
    """The kernel `name` built for `dtype` (`pdmesh_rms_norm_f32`, `..._bf16`)."""
    return getattr(lib, f"pdmesh_{name}_{NATIVE_DTYPES[dtype]}")


def supports(query: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """Whether `paged_decode_attention` can take these tensors: on the CPU, both float32 or
    both bfloat16, the cache contiguous."""
    return (query.device.type == "cpu" and kv_layer.device.type == "cpu"
            and query.dtype == kv_layer.dtype and query.dtype in NATIVE_DTYPES
            and kv_layer.is_contiguous() and library() is not None)


def paged_decode_attention(query: torch.Tensor, kv_layer: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, window: int = 0) -> torch.Tensor:
    """Decode rows `query[B, Hq, D]` against their paged context (CPU): the same result as
    `torch_ref.paged_decode_attention` up to float32 summation order (bfloat16: computed in
    float32, rounded once); `window` > 0: the last `window` tokens of each context only."""
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
    code = _kernel(lib, "paged_decode_attention", q.dtype)(
        q.data_ptr(), kv_layer.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
        batch, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks, tables.shape[1],
        window, scale)
    if code != 0:
        raise RuntimeError(f"native paged attention failed (code {code}: 1 bad shape, 2 out "
                           "of memory, 3 a block id outside the cache)")
    return out


def can_cache(key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor,
              slot_mapping: torch.Tensor) -> bool:
    """Whether `reshape_and_cache` takes these: on CPU, K, V and the cache all float32 or all
    bfloat16, each token's K (and V) row contiguous, the cache contiguous, int64 slots."""
    return (key.dim() == 3 and key.shape == value.shape
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value))
            and slot_mapping.dtype == torch.int64 and slot_mapping.shape == key.shape[:1]
            and supports(key, kv_layer) and value.dtype == key.dtype)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """`torch_ref.reshape_and_cache` in one call (see `can_cache`); slots are bounds-checked."""
    lib = library()
    assert lib is not None, "check can_cache() first"
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
    row = num_kv_heads * head_dim
    if key.shape[1] * key.shape[2] != row:
        raise ValueError(f"cache write: key {tuple(key.shape)} does not fit KV "
                         f"{tuple(kv_layer.shape)}")
    slots = slot_mapping.contiguous()
    code = _kernel(lib, "reshape_and_cache", kv_layer.dtype)(
        key.data_ptr(), value.data_ptr(), kv_layer.data_ptr(), slots.data_ptr(),
        key.shape[0], row, key.stride(0), value.stride(0), num_blocks * block_size)
    if code != 0:
        raise IndexError("cache write: a slot lies outside the KV cache")


# -- float32 linear layers from a weight packed at load time (csrc/linear_cpu.c) ---------------
LINEAR_BLOCK = 16
"""Output features per block of a packed weight ([ceil(N/16)][K][16])."""


def supports_linear(weight: torch.Tensor) -> bool:
    """Whether `linear` is the engine's GEMM for this weight: float32 on the CPU, the kernels
    built, and AVX-512 (where it was measured faster than oneDNN's packed GEMM at a decode
    step's rows; bench/README.md, "The decode step's kernels")."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and "avx512f" in _cpu_flags() and library() is not None)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A Linear's weight [N, K] in `linear`'s layout: blocks of 16 output features, k-major,
    zero past N."""
    lib = library()
    assert lib is not None, "check supports_linear() first"
    weight = weight.detach().contiguous()
    n, k = weight.shape
    packed = torch.empty(-(-n // LINEAR_BLOCK), k, LINEAR_BLOCK, dtype=torch.float32)
    _check(lib.pdmesh_linear_pack_f32(weight.data_ptr(), packed.data_ptr(), n, k), "linear pack")
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """`x @ W.T` for `packed = pack_linear_weight(W)`, x [..., K] float32."""
    lib = library()
    assert lib is not None, "check supports_linear() first"
    blocks, k = packed.shape[0], packed.shape[1]
    if x.dtype != torch.float32 or x.shape[-1] != k:
        raise ValueError(f"linear: input {tuple(x.shape)} {x.dtype} for a weight of {k} inputs")
    if not (blocks - 1) * LINEAR_BLOCK < out_features <= blocks * LINEAR_BLOCK:
        raise ValueError(f"linear: {out_features} outputs from {blocks} blocks of 16")
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    _check(lib.pdmesh_linear_f32(rows.data_ptr(), packed.data_ptr(), out.data_ptr(),
                                 rows.shape[0], k, out_features), "linear")
    return out.view(*x.shape[:-1], out_features)


# -- per-layer elementwise ops (csrc/layer_ops_cpu.c) ---------------------------------------------
def supports_layer_ops(*tensors: torch.Tensor) -> bool:
    """Whether the native layer ops can take these tensors: on the CPU, all float32 or all
    bfloat16."""
    return (len({t.dtype for t in tensors}) == 1 and tensors[0].dtype in NATIVE_DTYPES
            and all(t.device.type == "cpu" for t in tensors) and library() is not None)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """`x` as contiguous [rows, last dim] (a view when it already is)."""
    x = x.contiguous()
    n = x.shape[-1]
    return x, x.numel() // n if n else 0, n


def _check(code: int, op: str) -> None:
    if code != 0:
        raise RuntimeError(f"native {op} refused its shapes (code {code})")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    lib = library()
    assert lib is not None, "check supports_layer_ops() first"
    x, rows, n = _rows(x)
    weight = weight.contiguous()
    if weight.numel() != n:
        raise ValueError(f"rms_norm: weight of {weight.numel()} for rows of {n}")
    out = torch.empty_like(x)
    _check(_kernel(lib, "rms_norm", x.dtype)(x.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                             rows, n, eps), "rms_norm")
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """`residual += x` in place, then the RMSNorm of the new residual, in one pass per row."""
    lib = library()
    assert lib is not None, "check supports_layer_ops() first"
    if not residual.is_contiguous() or residual.shape != x.shape:
        raise ValueError("add_rms_norm: the residual must be contiguous and shaped like x")
    x, rows, n = _rows(x)
    weight = weight.contiguous()
    if weight.numel() != n:
        raise ValueError(f"add_rms_norm: weight of {weight.numel()} for rows of {n}")
    out = torch.empty_like(residual)
    _check(_kernel(lib, "add_rms_norm", x.dtype)(x.data_ptr(), residual.data_ptr(),
                                                 weight.data_ptr(), out.data_ptr(), rows, n,
                                                 eps), "add_rms_norm")
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    lib = library()
    assert lib is not None, "check supports_layer_ops() first"
    gate_up, rows, width = _rows(gate_up)
    if width % 2:
        raise ValueError(f"silu_and_mul: an odd last dimension ({width})")
    out = gate_up.new_empty((*gate_up.shape[:-1], width // 2))
    _check(_kernel(lib, "silu_and_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(),
                                                       rows, width // 2), "silu_and_mul")
    return out


def can_rope(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Rope in place needs each token's heads contiguous: [T, H, D] with strides (S, D, 1)."""
    return (q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0]
            and q.shape[2] == k.shape[2] and q.shape[2] % 2 == 0
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k))
            and supports_layer_ops(q, k))


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place on q and k (see `can_rope`); cos and sin are [T, D/2]."""
    lib = library()
    assert lib is not None, "check can_rope() first"
    tokens, hq, dim = q.shape
    cos, sin = cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()
    if cos.shape != (tokens, dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"rope: cos/sin {tuple(cos.shape)} for q {tuple(q.shape)}")
    _check(_kernel(lib, "rope", q.dtype)(q.data_ptr(), k.data_ptr(), cos.data_ptr(),
                                         sin.data_ptr(), tokens, hq, k.shape[1], dim,
                                         q.stride(0), k.stride(0)), "rope")


# -- KV blocks: per-block XXH64 and the pull that hashes while it copies (csrc/kv_blocks_cpu.c) ---
def supports_kv_blocks(*caches: torch.Tensor) -> bool:
    """Whether the native block hash can take these caches: on the CPU, contiguous
    `[layers, 2, blocks, ...]` (any dtype: it hashes bytes)."""
    return (all(c.device.type == "cpu" and c.dim() >= 3 and c.shape[2] > 0 and c.is_contiguous()
                for c in caches)
            and library() is not None)


def _kv_geometry(cache: torch.Tensor) -> tuple[int, int, int]:
    """(pieces per block, blocks, bytes per piece) of a `[layers, 2, blocks, ...]` cache."""
    layers, kv, blocks = cache.shape[:3]
    piece_bytes = cache[0, 0, 0].numel() * cache.element_size()
    return layers * kv, blocks, piece_bytes


def _ids(block_ids: Sequence[int]) -> np.ndarray:
    return np.fromiter(block_ids, dtype=np.int64, count=len(block_ids))


def _check_kv(code: int, op: str) -> None:
    if code == 3:
        raise IndexError(f"{op}: a block id lies outside its cache")
    if code != 0:
        raise RuntimeError(f"native {op} failed (code {code}: 1 bad shape, 4 a big-endian "
                           "build)")


def kv_blocks_xxh64(cache: torch.Tensor, block_ids: Sequence[int]) -> list[int]:
    """XXH64 (seed 0) of each block's (layer, K/V) pieces in order, in one call: equal to
    `xxhash.xxh64()` updated with the pieces (see `supports_kv_blocks`)."""
    lib = library()
    assert lib is not None, "check supports_kv_blocks() first"
    pieces, blocks, piece_bytes = _kv_geometry(cache)
    ids = _ids(block_ids)
    out = np.empty(len(ids), dtype=np.uint64)
    _check_kv(lib.pdmesh_kv_blocks_xxh64(cache.data_ptr(), pieces, blocks, piece_bytes,
                                         ids.ctypes.data, len(ids), out.ctypes.data,
                                         max(torch.get_num_threads(), 1)), "block hash")
    return out.tolist()


def kv_copy_blocks_xxh64(dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor,
                         src_ids: Sequence[int]) -> list[int]:
    """dst[:, :, dst_ids] = src[:, :, src_ids] and the XXH64 of each block written, in one
    pass over the bytes (each stripe hashed from the registers that stored it)."""
    lib = library()
    assert lib is not None, "check supports_kv_blocks() first"
    pieces, dst_blocks, piece_bytes = _kv_geometry(dst)
    src_pieces, src_blocks, src_piece_bytes = _kv_geometry(src)
    if (src_pieces, src_piece_bytes) != (pieces, piece_bytes) or len(src_ids) != len(dst_ids):
        raise ValueError(f"block copy: {len(src_ids)} blocks of {tuple(src.shape)} "
                         f"{src.dtype} into {len(dst_ids)} of {tuple(dst.shape)} {dst.dtype}")
    d, s = _ids(dst_ids), _ids(src_ids)
    out = np.empty(len(d), dtype=np.uint64)
    _check_kv(lib.pdmesh_kv_copy_blocks_xxh64(
        dst.data_ptr(), dst_blocks, src.data_ptr(), src_blocks, pieces, piece_bytes,
        d.ctypes.data, s.ctypes.data, len(d), out.ctypes.data,
        max(torch.get_num_threads(), 1)), "block copy")
    return out.tolist()


def main(argv: list[str] | None = None) -> int:
    """`python -m pdmesh.kernels.cpu_native prebuild [--out DIR] [--levels v4,v3]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pdmesh.kernels.cpu_native")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("prebuild", help="build the kernels per x86-64 ISA level, for "
                                            "machines without a compiler (container images)")
    build.add_argument("--out", type=Path, default=PREBUILT_DIR)
    build.add_argument("--levels", default=",".join(PREBUILT_LEVELS))
    args = parser.parse_args(argv)
    if platform.machine() not in ("x86_64", "AMD64"):
        print(f"prebuild: nothing to do on {platform.machine()} (levels are x86-64's)")
        return 0
    try:
        built = prebuild(args.out, tuple(x for x in args.levels.split(",") if x))
    except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as exc:
        print(f"prebuild: {exc}", file=sys.stderr)
        return 1
    for path in built:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
