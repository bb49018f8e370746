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
    # CUDA only (vLLM's --gpu-memory-utilization): the fraction of the GPU's memory this
    # engine may fill, weights and everything already in use included; the KV cache gets the
    # rest. Replaces kv_cache_memory when set.
    gpu_memory_utilization: float | None = None
    # Offline `LLM` only: where default sampling comes from (auto | vllm | a directory), see
    # engine/generation_config.py. Engines behind a router never read it: the router resolves.
    generation_config: str = "auto"
    # vLLM's --load-format: "auto" reads the checkpoint's safetensors; "dummy" builds the
    # architecture from config.json with random weights (benchmarks of shapes nobody
    # downloaded; the outputs are noise).
    load_format: Literal["auto", "dummy"] = "auto"
    # vLLM's --enforce-eager: never capture CUDA graphs (on CPU there are none anyway).
    enforce_eager: bool = False
    # vLLM's --async-scheduling: launch the next step before the current one's sampled ids
    # reach the host (engine/in_flight.py). None: on for CUDA, off on CPU (where the host is
    # the device and there is nothing to overlap).
    async_scheduling: bool | None = None
    # Serving only: run the engine core (scheduler, KV cache, model) in a process of its own,
    # so the service's gRPC threads never hold its GIL. The offline LLM keeps it in-process.
    engine_core_process: bool = True
    # torch's intra-op threads for the engine's compute; None: the core process picks
    # (engine/cpu_threads.py), an in-process engine leaves torch's default.
    cpu_threads: int | None = None
    # vLLM's --stream-interval: a streamed request's new output goes out once this many of
    # its tokens are pending (engine/output_processor.py); 1 = every token at once.
    stream_interval: int = 1

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
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if isinstance(self.stream_interval, bool) or not isinstance(self.stream_interval, int) \
                or self.stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got "
                             f"{self.stream_interval!r}")
        if self.cpu_threads is not None and not 1 <= self.cpu_threads <= 1024:
            raise ValueError(f"cpu_threads must be in [1, 1024], got {self.cpu_threads}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        from pdmesh.engine.generation_config import check_source

        check_source(self.generation_config)

    def kv_budget(self, free: int, total: int, cuda: bool) -> int:
        """KV cache bytes, given the device's `free` and `total` memory once the weights are
        loaded: gpu_memory_utilization x total minus what is in use (CUDA, when set), else
        kv_cache_memory (bytes, or a fraction of `free`)."""
        if cuda and self.gpu_memory_utilization is not None:
            budget = int(self.gpu_memory_utilization * total) - (total - free)
            if budget <= 0:
                raise ValueError(
                    f"gpu_memory_utilization: {self.gpu_memory_utilization} of "
                    f"{total / 2**30:.1f} GiB leaves nothing for the KV cache; "
                    f"{(total - free) / 2**30:.1f} GiB are in use already")
            return budget
        return parse_memory(self.kv_cache_memory, free)

    def use_async_scheduling(self, device: torch.device) -> bool:
        if self.async_scheduling is None:
            return device.type == "cuda"
        return self.async_scheduling

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
