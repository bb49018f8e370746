"""Engine configuration: one dataclass, validated at start-up with messages naming the field."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pdmesh.config import about
from pdmesh.engine.hf_overrides import parse_hf_overrides
from pdmesh.engine.request_rules import check_stream_interval
from pdmesh.engine.structured_output import DEFAULT_COMPILE_TIMEOUT_S

if TYPE_CHECKING:  # torch only where devices and dtypes are made: `pdmesh serve` parses this
    import torch

AUTO = "auto"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default: the share of its GPU an engine takes when no KV budget is given."""
CPU_KV_CACHE_MEMORY = "1GiB"
"""`--kv-cache-memory auto` off CUDA: a fixed budget (a CPU engine shares its host's memory
with everything else on it, so it never takes a fraction of it unasked)."""

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


def check_long_prefill_threshold(threshold: int, chunked_prefill: bool) -> None:
    """ValueError unless `threshold` (vLLM's long_prefill_token_threshold) is 0, or positive
    with chunked prefill on (it splits prompts into chunks)."""
    if threshold < 0:
        raise ValueError(f"long_prefill_token_threshold must be >= 0, got {threshold}")
    if threshold and not chunked_prefill:
        raise ValueError("long_prefill_token_threshold splits prompts into chunks: it needs "
                         "chunked prefill (--enable-chunked-prefill)")


@dataclass
class EngineConfig:
    """Every engine knob, declared here once: the engine services embed it (their flags
    `--block-size`, ...), and so does `pdmesh serve`, which hands it on to its engines."""

    model: str = field(default="smollm2", metadata=about("model alias, HF id or local path"))
    revision: str | None = field(default=None, metadata=about(
        "a Hub model's branch, tag or commit (vLLM's flag); unset = main"))
    download_dir: str | None = field(default=None, metadata=about(
        "where Hub models are downloaded and looked up (vLLM's flag); unset = the Hugging Face "
        "cache, $HF_HUB_CACHE or $HF_HOME/hub (HF_HUB_OFFLINE=1: the cache only, no network)"))
    tokenizer: str | None = field(default=None, metadata=about(
        "the tokenizer's alias, directory or Hub id, when not the model's own (vLLM's flag)"))
    tokenizer_revision: str | None = field(default=None, metadata=about(
        "the Hub tokenizer's branch, tag or commit (vLLM's flag): --tokenizer's, else the "
        "model repo's; unset = --tokenizer's default revision, or the model's --revision"))
    block_size: int = field(default=16, metadata=about("tokens per KV block"))
    max_num_seqs: int = field(default=256, metadata=about("max sequences per batch"))
    max_num_batched_tokens: int = field(default=2048, metadata=about("token budget per step"))
    itl_target_ms: float | None = field(default=None, metadata=about(
        "inter-token latency the scheduler keeps: a step with running streams takes only the "
        "prefill tokens that fit this many ms beside its decodes, by step costs learned while "
        "serving (engine/scheduling/step_budget.py); unset = auto (a step's prefill may delay the "
        "running streams by 2.4 stream-seconds in all, or half their own step time when "
        "more); 0 = off (only --max-num-batched-tokens bounds a step)"))
    max_model_len: int | None = field(default=None, metadata=about(
        "context limit (tokens); unset = the model's"))
    kv_cache_memory: int | float | str = field(default="auto", metadata=about(
        "KV cache budget: bytes, e.g. 2GiB, or a fraction of free memory, e.g. 0.2; auto = "
        "1GiB on CPU, on CUDA what --gpu-memory-utilization leaves after a profiling run. "
        "Given, it wins over --gpu-memory-utilization"))
    num_gpu_blocks_override: int | None = field(default=None, metadata=about(
        "the KV cache's size in blocks, on any device, whatever --kv-cache-memory or the "
        "profiling run say (vLLM's flag, for testing preemption and small caches)"))
    enable_prefix_caching: bool = field(default=True, metadata=about(
        "reuse the KV of shared prompt prefixes (vLLM's flag)"))
    kv_offload_host_bytes: int | str | None = field(default=None, metadata=about(
        "host-memory tier behind the paged cache: evicted prefix blocks are kept here (LRU, "
        "checksummed) and copied back on a prefix hit instead of recomputed; bytes, e.g. "
        "4GiB (vLLM's --kv-offloading-size, in bytes); unset = no tier "
        "(engine/core/kv_offload.py)"))
    kv_offload_disk_dir: str | None = field(default=None, metadata=about(
        "local-disk tier behind the host tier: blocks the host tier evicts are written under "
        "a directory of the engine's own inside this one (needs --kv-offload-host-bytes and "
        "--kv-offload-disk-bytes)"))
    kv_offload_disk_bytes: int | str | None = field(default=None, metadata=about(
        "the disk tier's size bound, e.g. 20GiB"))
    enable_chunked_prefill: bool = field(default=True, metadata=about(
        "split long prompts across steps, within --max-num-batched-tokens"))
    long_prefill_token_threshold: int = field(default=0, metadata=about(
        "the most tokens of one prompt a step takes (vLLM's flag): longer prompts go in chunks "
        "of this size, so several share a step and none holds the others up; 0 = no cap "
        "beyond --max-num-batched-tokens and --itl-target-ms"))
    scheduling_policy: Literal["fcfs", "priority"] = field(default="fcfs", metadata=about(
        "which waiting request runs first: the oldest, or by request priority"))
    dtype: str = field(default="auto", metadata=about(
        "weights and KV dtype; auto = float32 on CPU, bfloat16 on CUDA",
        ("auto", "float32", "bfloat16", "float16")))
    device: str = field(default="auto", metadata=about("auto|cpu|cuda[:N]"))
    tensor_parallel_size: int = field(default=1, metadata=about(
        "ranks the model is split over (vLLM's flag, -tp): attention heads, MLP columns and "
        "vocabulary; one process per rank (the engine core is rank 0), gloo on CPU (the "
        "engine's threads split over the ranks), NCCL on CUDA (one device per rank, from "
        "--device's index on)", aliases=("-tp",)))
    attention_backend: str = field(default="auto", metadata=about(
        "auto|flash-attn|triton|cpu|torch (auto picks by device)"))
    seed: int = field(default=0, metadata=about("engine seed (unseeded requests)"))
    hash_algorithm: str = field(default="sha256", metadata=about("block hash algorithm"))
    hash_root_seed: str = field(default="pdmesh", metadata=about("block hash chain root"))
    gpu_memory_utilization: float | None = field(default=None, metadata=about(
        "CUDA: the fraction of the GPU's memory this engine may use, weights, activations, "
        "CUDA graphs and KV cache together (vLLM's flag); the KV cache gets what a profiling "
        "run at start-up leaves. Unset = 0.9; unused when --kv-cache-memory is given. Engines "
        "sharing a GPU each take their own fraction",
        aliases=("--device-memory-utilization",)))
    # Engines behind a router never read it: the router resolves sampling defaults.
    generation_config: str = field(default="auto", metadata=about(
        "offline LLM only: where default sampling comes from (auto | vllm | a directory, "
        "engine/generation_config.py)", cli=False))
    override_generation_config: dict[str, Any] | None = field(default=None, metadata=about(
        "offline LLM only: sampling defaults merged over generation_config's, in "
        "generation_config.json's names (vLLM's argument)", cli=False))
    hf_overrides: str = field(default="", metadata=about(
        "a JSON object merged over the model's config.json before the engine reads it "
        "(vLLM's flag), e.g. '{\"max_position_embeddings\": 4096}'; the offline LLM also "
        "takes a dict (engine/hf_overrides.py)"))
    quantization: str | None = field(default=None, metadata=about(
        "the checkpoint's quantization method, checked against its config.json (vLLM's flag): "
        "pdmesh reads it from the checkpoint (fp8: dequantized to --dtype at load) and never "
        "quantizes an unquantized one", aliases=("-q",)))
    load_format: Literal["auto", "dummy"] = field(default="auto", metadata=about(
        "auto: the checkpoint's safetensors; dummy: random weights of the model's shape "
        "(benchmarks of shapes nobody downloaded; the outputs are noise)"))
    disable_sliding_window: bool = field(default=False, metadata=about(
        "attend over the whole context in every layer and cap max_model_len to the model's "
        "sliding window (vLLM's flag); by default sliding layers attend over their window"))
    enforce_eager: bool = field(default=False, metadata=about(
        "never capture CUDA graphs for decode steps (vLLM's flag; no effect on CPU)"))
    async_scheduling: bool | None = field(default=None, metadata=about(
        "launch each step before the previous one's sampled tokens reach the host "
        "(engine/worker/in_flight.py; vLLM's flag); unset: on for CUDA, off on CPU"))
    # The offline LLM keeps the core in-process whatever this says.
    engine_core_process: bool = field(default=True, metadata=about(
        "run the engine core (scheduler, KV cache, model) in its own process, away from "
        "the serving process's GIL"))
    # An in-process engine (the offline LLM) leaves torch's default when unset.
    cpu_threads: int | None = field(default=None, metadata=about(
        "torch threads of the engine core; default: every usable CPU on a CPU device, 1 on "
        "CUDA (or OMP_NUM_THREADS when set; engine/worker/cpu_threads.py)"))
    stream_interval: int = field(default=1, metadata=about(
        "stream a request's output once this many new tokens are pending (the first and the "
        "last at once; vLLM's flag): fewer, larger messages on every hop for a little "
        "burstiness; a request's own stream_interval may raise it"))
    structured_output_compile_timeout_s: float = field(
        default=DEFAULT_COMPILE_TIMEOUT_S, metadata=about(
            "a structured-output spec must compile within this many seconds (tried in a "
            "process that is killed when it passes, engine/structured/grammar_sandbox.py); a "
            "slower one is refused with a 400"))

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8/16/32/64/128, got {self.block_size}")
        if self.kv_cache_memory != AUTO:
            parse_memory(self.kv_cache_memory, available=1)  # raises on what it cannot read
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(f"num_gpu_blocks_override must be >= 2, got "
                             f"{self.num_gpu_blocks_override}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_long_prefill_threshold(self.long_prefill_token_threshold,
                                     self.enable_chunked_prefill)
        if self.itl_target_ms is not None and not 0 <= self.itl_target_ms <= 600_000:
            raise ValueError(f"itl_target_ms must be in [0, 600000], got {self.itl_target_ms}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto/float32/bfloat16/float16, got {self.dtype!r}")
        from pdmesh.kernels.backend_names import BACKEND_NAMES

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
        check_stream_interval(self.stream_interval)
        self.kv_offload_sizes()  # raises on what it cannot read or use
        if not 0 < self.structured_output_compile_timeout_s <= 3600:
            raise ValueError(f"structured_output_compile_timeout_s must be in (0, 3600], got "
                             f"{self.structured_output_compile_timeout_s}")
        if not 1 <= self.tensor_parallel_size <= 1024:
            raise ValueError(f"tensor_parallel_size must be in [1, 1024], got "
                             f"{self.tensor_parallel_size}")
        if self.cpu_threads is not None and not 1 <= self.cpu_threads <= 1024:
            raise ValueError(f"cpu_threads must be in [1, 1024], got {self.cpu_threads}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        from pdmesh.engine.generation_config import check_source, parse_override

        check_source(self.generation_config)
        parse_override(self.override_generation_config)
        parse_hf_overrides(self.hf_overrides)

    def profiles_memory(self, device: torch.device) -> bool:
        """Whether the KV cache is sized by `--gpu-memory-utilization` after a profiling run
        (CUDA with no --kv-cache-memory given) rather than by `kv_budget`."""
        return device.type == "cuda" and self.kv_cache_memory == AUTO

    @property
    def memory_utilization(self) -> float:
        """`--gpu-memory-utilization`, or vLLM's default when unset."""
        if self.gpu_memory_utilization is None:
            return DEFAULT_GPU_MEMORY_UTILIZATION
        return self.gpu_memory_utilization

    def kv_budget(self, free: int) -> int:
        """KV cache bytes by `--kv-cache-memory` (bytes, or a fraction of `free`, the memory
        free once the weights are loaded); auto is 1GiB, what a CPU engine takes by default.
        A CUDA engine with auto profiles instead (`profiles_memory`)."""
        value = CPU_KV_CACHE_MEMORY if self.kv_cache_memory == AUTO else self.kv_cache_memory
        return parse_memory(value, free)

    def kv_offload_sizes(self) -> tuple[int, int]:
        """(host tier bytes, disk tier bytes); (0, 0) = no offload tier."""
        host = disk = 0
        if self.kv_offload_host_bytes is not None:
            host = parse_memory(self.kv_offload_host_bytes, available=1)
            if host < 1:
                raise ValueError(f"kv_offload_host_bytes: {self.kv_offload_host_bytes!r} is "
                                 "no size in bytes (try '4GiB')")
        if self.kv_offload_disk_bytes is not None:
            disk = parse_memory(self.kv_offload_disk_bytes, available=1)
            if disk < 1:
                raise ValueError(f"kv_offload_disk_bytes: {self.kv_offload_disk_bytes!r} is "
                                 "no size in bytes (try '20GiB')")
        if (self.kv_offload_disk_dir is None) != (self.kv_offload_disk_bytes is None):
            raise ValueError("kv_offload_disk_dir and kv_offload_disk_bytes go together")
        if disk and not host:
            raise ValueError("kv_offload_disk_dir: the disk tier sits behind the host tier; "
                             "set kv_offload_host_bytes too")
        if host and not self.enable_prefix_caching:
            raise ValueError("kv_offload_host_bytes: the offload tier keeps prefix-cache "
                             "blocks; it needs enable_prefix_caching")
        if host and self.tensor_parallel_size > 1:
            raise ValueError("kv_offload_host_bytes: the offload tier copies rank 0's cache "
                             "only; it is not supported with tensor_parallel_size > 1 yet")
        return host, disk

    def use_async_scheduling(self, device: torch.device) -> bool:
        if self.async_scheduling is None:
            return device.type == "cuda"
        return self.async_scheduling

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device: CUDA was requested but no CUDA device is available")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            # fp32 on CPU: these CPUs lack fast bf16 GEMMs (~0.9 vs ~140 GFLOP/s measured).
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)
