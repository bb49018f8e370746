"""Start-up: the model on its device and a paged KV cache sized to the memory left.

Sizing runs once, in this order: the model's position table bounds `max_model_len`; the
weights are loaded; the memory left after them (the GPU's, or the host's on CPU) gives the KV
budget (`EngineConfig.kv_budget`), hence the number of blocks; `max_model_len` is then the
longest context that both the model and the cache hold, unless one was asked for (which must
fit both). The cache is one tensor `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`
whose host pages are committed only as blocks are first used (engine/core/memory.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from pdmesh.engine.block_hash import HashScheme
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core.host_allocator import keep_temporaries_on_heap
from pdmesh.engine.core.memory import lazy_zeros
from pdmesh.engine.core_types import CoreInfo
from pdmesh.engine.model_store import model_dir_for
from pdmesh.engine.tokenizing import eos_token_ids  # noqa: F401 - its old home
from pdmesh.engine.worker.model_loader import load_hf_config, load_model
from pdmesh.engine.worker.models.llama import LlamaForCausalLM, ModelConfig
from pdmesh.kvstore.connector.cache_file import SharedCache, room_for, shared_zeros
from pdmesh.kvstore.connector.config import KVConnectorConfig

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

    @property
    def num_blocks(self) -> int:
        return int(self.kv_cache.shape[2])


def set_up_engine(config: EngineConfig,
                  connector: KVConnectorConfig | None = None) -> EngineSetup:
    """Load the model and allocate its KV cache (ValueError when the budget does not hold
    two blocks or the asked max_model_len). With a KV connector that shares the cache, a CPU
    cache lives in a shm file that peer cores on the host copy blocks out of."""
    model_dir = model_dir_for(config)
    device = config.torch_device()
    dtype = config.torch_dtype(device)
    if config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
    if device.type == "cpu":
        keep_temporaries_on_heap()  # engine/core/host_allocator.py: no page faults per step
    torch.manual_seed(config.seed)
    max_positions = model_max_positions(model_dir, config.max_model_len)
    model, model_config, hf_config = load_model(
        model_dir, dtype, device, max_positions, load_format=config.load_format)
    scheme = HashScheme(block_size=config.block_size, algorithm=config.hash_algorithm,
                        root_seed=config.hash_root_seed)
    num_blocks = num_kv_blocks(config, model_config, dtype, device)
    mc = model_config
    shape = (mc.num_layers, 2, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
    cache_file = None
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if connector is not None and connector.shared_cache and device.type == "cpu":
        room = room_for(connector.shm_dir, nbytes)
        if room >= nbytes:
            cache_file = shared_zeros(shape, dtype, connector.shm_dir, connector.owner_pid)
        else:
            logger.warning("the KV cache is not shared: %s has %.0f MiB free for a %.0f MiB "
                           "cache (peers on this host pull over tcp); raise its size, e.g. "
                           "docker --shm-size", connector.shm_dir, room / 2**20, nbytes / 2**20)
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
    logger.info(summary)
    return EngineSetup(model_dir, device, dtype, model, model_config, hf_config, scheme,
                       kv_cache, max_model_len, summary, cache_file)


def model_max_positions(model_dir: Path, wanted: int | None) -> int:
    """The model's position limit; ValueError when the asked max_model_len exceeds it."""
    hf = load_hf_config(model_dir)
    limit = int(getattr(hf, "max_position_embeddings", 2048))
    if wanted is not None and wanted > limit:
        raise ValueError(
            f"max_model_len={wanted} exceeds the model's max_position_embeddings={limit}")
    return limit


def num_kv_blocks(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype,
                  device: torch.device) -> int:
    """Blocks the KV budget holds, measured once the weights are loaded."""
    bs = config.block_size
    bytes_per_block = mc.num_layers * 2 * bs * mc.num_kv_heads * mc.head_dim * dtype.itemsize
    if device.type == "cuda":
        available, total = torch.cuda.mem_get_info(device)
    else:
        available = total = psutil.virtual_memory().available
    budget = config.kv_budget(available, total, cuda=device.type == "cuda")
    if budget > available:
        raise ValueError(
            f"kv_cache_memory: {budget / 2**30:.2f} GiB requested but only "
            f"{available / 2**30:.2f} GiB is available"
        )
    num_blocks = budget // bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory: {budget} bytes holds fewer than 2 blocks "
            f"({bytes_per_block} bytes each)"
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


