"""Start-up: the model on its device and a paged KV cache sized to the memory left.

Sizing runs once, in this order: the engine's device is made current (`engine_device`,
`make_device_current`); the model's position table bounds `max_model_len`; the weights are
loaded; on CUDA without a `--kv-cache-memory`, a profiling run of the largest step measures
what the engine needs besides its cache (engine/core/memory_profile.py) and the cache gets
what `--gpu-memory-utilization` leaves; otherwise `--kv-cache-memory` (`EngineConfig.kv_budget`)
is the budget. The budget gives the number of blocks; `max_model_len` is then the longest
context that both the model and the cache hold, unless one was asked for (which must fit
both). The cache is one tensor `[layers, 2, num_blocks, block_size, kv_heads, head_dim]` whose
host pages are committed only as blocks are first used (engine/core/memory.py).

With tensor parallelism every rank runs this same set-up on its own shard (engine/core/ranks.py),
side by side: each loads its slice, profiles (CUDA) and budgets its own memory for a cache of
its own KV heads; the ranks then agree on the smallest block count, since one scheduler hands
out the same block ids on every rank.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import psutil
import torch

from pdmesh.engine.block_hash import HashScheme
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core.host_allocator import keep_temporaries_on_heap
from pdmesh.engine.core.memory import lazy_zeros
from pdmesh.engine.core.memory_profile import (
    DeviceMemory,
    MemoryProfile,
    gpu_kv_budget,
    measure_memory_profile,
    read_device_memory,
)
from pdmesh.engine.core_types import CoreInfo
from pdmesh.engine.hf_overrides import parse_hf_overrides
from pdmesh.engine.model_store import model_dir_for
from pdmesh.engine.worker.cuda_graphs import graphs_unavailable_reason
from pdmesh.engine.worker.hf_config import load_hf_config
from pdmesh.engine.worker.model_loader import load_model
from pdmesh.engine.worker.models.architecture import ModelConfig, sliding_window
from pdmesh.engine.worker.models.llama import LlamaForCausalLM
from pdmesh.engine.worker.parallel.group import SINGLE, TensorParallel
from pdmesh.kernels.backend_selection import get_attention_backend
from pdmesh.kvstore.connector.cache_file import SharedCache, room_for, shared_zeros
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.connector import KVConnector

logger = logging.getLogger(__name__)


@dataclass
class EngineSetup:
    """What the engine core is built on: the model, its KV cache and the limits they set."""

    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    model: LlamaForCausalLM
    model_config: ModelConfig
    hf_config: Any
    scheme: HashScheme
    kv_cache: torch.Tensor
    max_model_len: int
    capacity_summary: str
    cache_file: SharedCache | None = None
    memory_profile: MemoryProfile | None = None  # CUDA sized by --gpu-memory-utilization
    ranks_share_caches: bool = False  # tensor parallelism: ranks 1..N-1's caches are shm files

    @property
    def num_blocks(self) -> int:
        return int(self.kv_cache.shape[2])


def set_up_engine(config: EngineConfig, connector: KVConnectorConfig | None = None,
                  tp: TensorParallel = SINGLE, cache_name: str = "") -> EngineSetup:
    """Load the model and allocate its KV cache (ValueError when the budget does not hold
    two blocks or the asked max_model_len). With a KV connector that shares the cache, a CPU
    cache lives in a shm file that peer cores on the host copy blocks out of (`cache_name`:
    the file's name, as rank 0 gave it to its other ranks). Leaves the engine's CUDA device
    current on the calling thread."""
    model_dir = model_dir_for(config)
    device = resolve_engine_device(config)
    make_device_current(device)
    dtype = config.torch_dtype(device)
    if config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
    if device.type == "cpu":
        keep_temporaries_on_heap()  # engine/core/host_allocator.py: no page faults per step
    start = read_device_memory(device) if config.profiles_memory(device) else None
    torch.manual_seed(config.seed)
    overrides = parse_hf_overrides(config.hf_overrides)
    max_positions = model_max_positions(model_dir, config.max_model_len, overrides,
                                        config.disable_sliding_window)
    if config.disable_sliding_window:  # every layer full; max_positions is within the window
        overrides = {**overrides, "sliding_window": None}
    model, model_config, hf_config = load_model(
        model_dir, dtype, device, max_positions, load_format=config.load_format, tp=tp,
        hf_overrides=overrides, quantization=config.quantization)
    scheme = HashScheme(block_size=config.block_size, algorithm=config.hash_algorithm,
                        root_seed=config.hash_root_seed)
    mc = model_config
    kv_heads = model.shard.kv_heads.size  # this rank's (all of them without tensor parallelism)
    bytes_per_block = (mc.num_layers * 2 * config.block_size * kv_heads * mc.head_dim
                       * dtype.itemsize)
    budget, profile = kv_budget_bytes(config, model, device, start, max_positions)
    if config.num_gpu_blocks_override is not None:  # vLLM's: whatever the budget says
        budget = config.num_gpu_blocks_override * bytes_per_block
    num_blocks = num_kv_blocks(budget, bytes_per_block, free_memory(device))
    if tp.world_size > 1:
        num_blocks = int(tp.all_reduce(torch.tensor([num_blocks], device=device), "min").item())
    shape = (mc.num_layers, 2, num_blocks, config.block_size, kv_heads, mc.head_dim)
    cache_file = None
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if connector is not None and connector.shared_cache and device.type == "cpu":
        room = room_for(connector.shm_dir, nbytes)
        if room >= nbytes:
            cache_file = shared_zeros(shape, dtype, connector.shm_dir, connector.owner_pid,
                                      cache_name)
        else:
            logger.warning("the KV cache is not shared: %s has %.0f MiB free for a %.0f MiB "
                           "cache (peers on this host pull over tcp); raise its size, e.g. "
                           "docker --shm-size", connector.shm_dir, room / 2**20, nbytes / 2**20)
    shared_by_all = cache_file is not None or tp.rank == 0  # rank 0 reads the others'
    if tp.world_size > 1:  # every rank is past its allocation once this returns
        shared_by_all = bool(tp.all_reduce(torch.tensor([int(shared_by_all)], device=device),
                                           "min").item())
    if cache_file is not None:
        kv_cache = cache_file.tensor
    else:
        kv_cache = lazy_zeros(shape, dtype=dtype, device=device)  # pages committed on use
    capacity = num_blocks * config.block_size
    max_model_len = resolve_max_model_len(config.max_model_len, max_positions, capacity)
    summary = (
        f"KV cache: {num_blocks} blocks x {config.block_size} tokens = {capacity} tokens "
        f"({kv_cache.numel() * kv_cache.element_size() / 2**20:.1f} MiB, "
        f"{dtype}, {device}); max_model_len={max_model_len}"
    )
    if profile is not None:
        summary += "; " + profile.describe(config.memory_utilization)
    logger.info(summary)
    return EngineSetup(model_dir, device, dtype, model, model_config, hf_config, scheme,
                       kv_cache, max_model_len, summary, cache_file, profile, shared_by_all)


def engine_device(device: torch.device, current_index: int, device_count: int) -> torch.device:
    """The engine's device with its index spelled out: plain `cuda` is the current CUDA
    device (0 in a fresh process), and what is made current, what tensors land on and what
    other threads switch to must all name the same one. ValueError for a device that is not
    there (CUDA_VISIBLE_DEVICES renumbers the visible ones from 0)."""
    if device.type != "cuda":
        return device
    index = current_index if device.index is None else device.index
    if not 0 <= index < device_count:
        raise ValueError(f"device: cuda:{index} does not exist ({device_count} CUDA devices "
                         "are visible)")
    return torch.device("cuda", index)


def resolve_engine_device(config: EngineConfig) -> torch.device:
    """`config.device` resolved (auto, cuda[:N], cpu) to the device the engine runs on."""
    device = config.torch_device()
    if device.type != "cuda":
        return device
    return engine_device(device, torch.cuda.current_device(), torch.cuda.device_count())


def make_device_current(device: torch.device) -> None:
    """Make the engine's CUDA device current on this thread. CUDA's current device is per
    thread, and Triton launches, graph capture and `Event.record()` act on the current
    device's stream, so every thread that runs the engine's device work calls this first
    (start-up, the thread that steps the core; the KV connector's threads use
    `on_device_of`). Nothing to do on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def free_memory(device: torch.device) -> int:
    """Bytes free on `device` now: the GPU's, or the host's available memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def kv_budget_bytes(config: EngineConfig, model: LlamaForCausalLM, device: torch.device,
                    start: DeviceMemory | None, max_positions: int
                    ) -> tuple[int, MemoryProfile | None]:
    """The KV cache's bytes, once the weights are loaded, and the profile they came from:
    with a `start` reading (CUDA, no --kv-cache-memory given) what --gpu-memory-utilization
    leaves after a profiling run, else --kv-cache-memory (`EngineConfig.kv_budget`)."""
    if start is not None:
        profile = profile_memory(config, model, device, start, max_positions)
        return gpu_kv_budget(config.memory_utilization, profile), profile
    if device.type == "cuda" and config.gpu_memory_utilization is not None:
        logger.info("--kv-cache-memory %s is given: --gpu-memory-utilization %s is not used",
                    config.kv_cache_memory, config.gpu_memory_utilization)
    return config.kv_budget(free_memory(device)), None


def profile_memory(config: EngineConfig, model: LlamaForCausalLM, device: torch.device,
                   start: DeviceMemory, max_positions: int) -> MemoryProfile:
    """The start-up memory profile with the engine's own attention backend and step limits."""
    backend = get_attention_backend(config.attention_backend, device,
                                    block_size=config.block_size)
    graphs = graphs_unavailable_reason(device, backend, config.enforce_eager) is None
    return measure_memory_profile(
        model, backend, start, device, block_size=config.block_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs, max_positions=max_positions, graphs=graphs)


def model_max_positions(model_dir: Path, wanted: int | None,
                        hf_overrides: Mapping[str, Any] | None = None,
                        disable_sliding_window: bool = False) -> int:
    """The model's position limit: its max_position_embeddings (a sliding attention window
    does not limit it, the kernels mask outside it), or with `disable_sliding_window` (vLLM's
    --disable-sliding-window: full attention everywhere, exact only within the window) its
    window; ValueError when the asked max_model_len exceeds it."""
    hf = load_hf_config(model_dir, hf_overrides)
    limit = int(getattr(hf, "max_position_embeddings", 2048))
    if wanted is not None and wanted > limit:
        raise ValueError(
            f"max_model_len={wanted} exceeds the model's max_position_embeddings={limit}")
    window = sliding_window(hf) if disable_sliding_window else None
    if window is None or window >= limit:
        return limit
    if wanted is not None and wanted > window:
        raise ValueError(
            f"max_model_len={wanted} exceeds the model's sliding attention window of {window} "
            f"tokens, which --disable-sliding-window caps it to")
    return window


def num_kv_blocks(budget: int, bytes_per_block: int, available: int) -> int:
    """Blocks a KV budget of `budget` bytes holds; ValueError when `available` memory (free
    once the weights are loaded) cannot hold the budget or it holds fewer than 2 blocks."""
    if budget > available:
        raise ValueError(
            f"kv_cache_memory: {budget / 2**30:.2f} GiB requested but only "
            f"{available / 2**30:.2f} GiB is available"
        )
    num_blocks = budget // bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory: {budget} bytes holds fewer than 2 blocks "
            f"({bytes_per_block} bytes each); raise --kv-cache-memory (or, on CUDA without "
            "it, --gpu-memory-utilization)"
        )
    return int(num_blocks)


def resolve_max_model_len(wanted: int | None, max_positions: int, capacity: int) -> int:
    """The asked length if the cache holds it, else the longest both model and cache hold."""
    if wanted is not None and wanted > capacity:
        raise ValueError(
            f"max_model_len={wanted} does not fit in the KV cache ({capacity} tokens); "
            "raise kv_cache_memory or lower max_model_len"
        )
    return wanted if wanted is not None else min(max_positions, capacity)


def with_connector(info: CoreInfo, connector: KVConnector | None) -> CoreInfo:
    """`info` with where peers reach the core's KV connector (its cache file, block server,
    IPC handle, UCX address) and its checksum algorithm; as is without a connector."""
    if connector is None:
        return info
    return msgspec.structs.replace(
        info, kv_cache_file=connector.cache_file_name,
        kv_block_server=connector.block_server_address,
        kv_cache_ipc=connector.cache_ipc,
        kv_ucx_server=connector.ucx_address,
        kv_checksum_algo=str(connector.algo))


def core_info(setup: EngineSetup, block_size: int) -> CoreInfo:
    """The core's fixed figures, as the serving side sees them."""
    mc = setup.model_config
    return CoreInfo(
        block_size=block_size,
        max_model_len=setup.max_model_len,
        num_total_blocks=setup.num_blocks,
        vocab_size=mc.vocab_size,
        kv_shape=(mc.num_layers, block_size, mc.num_kv_heads, mc.head_dim),
        kv_dtype=str(setup.dtype).removeprefix("torch."),
        hash_fingerprint=setup.scheme.fingerprint(),
        hash_description=setup.scheme.describe(),
        capacity_summary=setup.capacity_summary,
        torch_threads=torch.get_num_threads(),
    )


