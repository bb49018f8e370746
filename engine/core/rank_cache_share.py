"""How a tensor-parallel core's ranks hand rank 0 their KV caches, so that its KV connector
moves every rank's slice of a block itself (kvstore/connector/rank_caches.py).

Only rank 0 (the engine core) has a connector; ranks 1..N-1 never hear of KV transfer. So
rank 0 must reach every rank's cache:

* **CPU**: rank 0 names a shared-memory file for each other rank before starting it; the rank
  allocates its cache in that file (`set_up_engine`), and rank 0 maps them all writable
  (the files are the engine's, named after the serving process like its own, so the sweeps
  after a dead service remove them; rank 0 unlinks them when it closes).
* **CUDA**: each rank shares its cache's allocation by a CUDA IPC handle
  (`kvstore/connector/cuda_ipc.py`: plain JSON, never pickled) written to the group's private
  rendezvous directory, and rank 0 maps them into its own device's context (peer access:
  no CUDA context of rank 0's on the ranks' GPUs; torch's opener where the GPUs have no peer
  access). Never exercised without two GPUs (tests/engine/test_kv_pull_across_tp.py runs it
  where they are).

Both end in one collective, a barrier every rank joins once its cache is published, where the
ranks agree whether all of them could share; if one could not, rank 0 runs without a
connector (colocated only) and says why.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch

from pdmesh.engine.core.startup import EngineSetup
from pdmesh.engine.worker.parallel.group import TensorParallel
from pdmesh.engine.worker.parallel.sharding import ModelShard
from pdmesh.kvstore.connector.cache_file import cache_file_name, open_peer
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.cuda_ipc import open_peer as open_device_peer
from pdmesh.kvstore.connector.cuda_ipc import share, unshare
from pdmesh.kvstore.connector.rank_caches import RankCaches

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheShare:
    """How ranks 1..N-1 hand rank 0 their caches; nothing at all without a connector."""

    files: tuple[str, ...] = ()  # CPU: rank r's shm file is files[r - 1], named by rank 0
    shm_dir: str = ""
    ipc: bool = False  # CUDA: each rank publishes its cache's IPC description

    @property
    def active(self) -> bool:
        return bool(self.files) or self.ipc


@dataclass(frozen=True)
class SharedRanks:
    """What rank 0 holds of every rank's cache once they shared: the caches, and what peers
    are told (the files' names or the IPC descriptions, in rank order)."""

    caches: RankCaches
    files: tuple[str, ...] = ()  # ranks 1..N-1 (rank 0's own is its connector's cache file)
    ipcs: tuple[str, ...] = ()  # every rank's, rank 0's first


def plan_share(connector: KVConnectorConfig | None, device: torch.device,
               world: int) -> tuple[KVConnectorConfig | None, CacheShare]:
    """The connector a tensor-parallel core runs and how its ranks share their caches: shm
    files on CPU (whichever transports peers use), IPC handles on CUDA."""
    if connector is None:
        return None, CacheShare()
    if device.type == "cuda":
        return connector, CacheShare(ipc=True)
    # in shm files whether or not peers may map them (the shm transport): rank 0 reads them
    files = tuple(cache_file_name(connector.owner_pid) for _ in range(1, world))
    return connector, CacheShare(files, connector.shm_dir)


def _ipc_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"cache-{rank}.ipc")


def _all_shared(tp: TensorParallel, device: torch.device, ok: bool) -> bool:
    """The barrier every rank joins once its cache is published: whether all could."""
    return bool(tp.all_reduce(torch.tensor([int(ok)], device=device), "min").item())


def publish(share_how: CacheShare, directory: str, setup: EngineSetup,
            tp: TensorParallel) -> None:
    """Rank r's side, after its set-up (on CPU its cache is already in its file, and the
    set-up's own collective said whether every rank's is)."""
    if not share_how.ipc:
        return
    description = share(setup.kv_cache)
    if description:
        with open(_ipc_path(directory, tp.rank), "w", encoding="utf-8") as out:
            out.write(description)
    _all_shared(tp, setup.device, bool(description))


def collect(share_how: CacheShare, directory: str, setup: EngineSetup,
            tp: TensorParallel) -> SharedRanks | None:
    """Rank 0's side: every rank's cache, or None where one could not be shared (then the
    core runs without a connector). ValueError for a CPU cache that did not fit in shm."""
    mc, world = setup.model_config, tp.world_size

    def heads(rank: int) -> tuple[int, ...]:
        return (*setup.kv_cache.shape[:4], ModelShard.of(mc, rank, world).kv_heads.size,
                setup.kv_cache.shape[5])

    if share_how.files:
        if not setup.ranks_share_caches:
            raise ValueError("tensor parallelism with KV moves: a rank's KV cache did not fit "
                             f"in {share_how.shm_dir} (raise its size, e.g. docker --shm-size)")
        caches = [setup.kv_cache]
        for rank, name in enumerate(share_how.files, start=1):
            caches.append(open_peer(share_how.shm_dir, name, heads(rank), setup.dtype,
                                    writable=True))
        return SharedRanks(RankCaches(tuple(caches), mc), files=share_how.files)
    own = share(setup.kv_cache)
    if not _all_shared(tp, setup.device, bool(own)):
        logger.warning("tensor parallelism: a rank's KV cache cannot be shared over CUDA IPC, "
                       "so this core lends and pulls no KV blocks")
        return None
    descriptions = [own]
    for rank in range(1, world):
        with open(_ipc_path(directory, rank), encoding="utf-8") as f:
            descriptions.append(f.read())
    caches = [setup.kv_cache]
    for rank, description in enumerate(descriptions[1:], start=1):
        cache = open_device_peer(description, setup.kv_cache.device).tensor  # kept for life
        if tuple(cache.shape) != heads(rank) or cache.dtype != setup.dtype:
            raise ValueError(f"tensor parallelism: rank {rank}'s shared KV cache has another "
                             "layout")
        caches.append(cache)
    return SharedRanks(RankCaches(tuple(caches), mc), ipcs=tuple(descriptions))


def release(share_how: CacheShare, shared: SharedRanks | None) -> None:
    """Undo the sharing once the ranks are gone: unlink their cache files (the mappings live
    on until dropped) and give back rank 0's own IPC share (`collect`), so torch may free its
    cache (the ranks' shares ended with their processes)."""
    if shared is not None and shared.ipcs:
        unshare(shared.ipcs[0])
    for name in share_how.files:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(os.path.realpath(share_how.shm_dir), name))
