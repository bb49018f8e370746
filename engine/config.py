"""Engine configuration: one dataclass, validated at start-up with messages naming the field."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "KI": 2**10,
    "MI": 2**20,
    "GI": 2**30,
    "TI": 2**40,
}


def parse_memory(value: int | float | str, available: int) -> int:
    """Bytes from an int, a fraction of `available` (0 < f <= 1), or a string like '2GiB'."""
    if isinstance(value, str):
        m = _SIZE.match(value)
        if not m:
            raise ValueError(f"kv_cache_memory: cannot parse {value!r} (try '2GiB' or 0.2)")
        unit = (m.group(2) or "").upper().removesuffix("B")
        return int(float(m.group(1)) * _UNITS[unit])
    if isinstance(value, float) and value <= 1.0:
        if value <= 0:
            raise ValueError(f"kv_cache_memory fraction must be in (0, 1], got {value}")
        return int(value * available)
    if value <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {value}")
    return int(value)


@dataclass
class EngineConfig:
    model: str = "smollm2"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_memory: int | float | str = "1GiB"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0
    hash_algorithm: str = "sha256"
    hash_root_seed: str = "pdmesh"

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8/16/32/64/128, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto/float32/bfloat16/float16, got {self.dtype!r}")
        from pdmesh.kernels.backend import BACKEND_NAMES

        names = {"auto", *BACKEND_NAMES, *(n.replace("-", "_") for n in BACKEND_NAMES)}
        if self.attention_backend not in names:
            raise ValueError(
                f"attention_backend must be auto or one of {', '.join(BACKEND_NAMES)}, "
                f"got {self.attention_backend!r}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device: CUDA was requested but no CUDA device is available")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            # fp32 on CPU: these CPUs lack fast bf16 GEMMs (~0.9 vs ~140 GFLOP/s measured).
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)
