"""`KVConnector`: the engine core's end of KV transfer (the worker side of the connector).

The core asks it two things between steps on the core's own thread:

* **export** (sender): a request finished its prefill with its blocks pinned; register them
  for pulls (the block server reads them from its threads) and checksum each block;
  **release** when the serving process says the lease ended;
* **load** (receiver): fill these blocks of our cache with the export's blocks from
  `first_block` on (the ones before are our own prefix-cache hits), through the transport the
  serving process negotiated, then check every pulled block against the sender's checksum
  (computed while copying on a same-host CPU pull, by reading the blocks back otherwise).
  `start_load` runs it on the connector's own threads (the copies and socket reads release the
  GIL), so the core keeps stepping its running requests while a prompt's KV arrives; the core
  lands a finished load between two steps.

A tensor-parallel core (rank 0) moves every rank's slice of a block (`rank_caches.py`): its
ranks' caches are shared-memory files it maps (CUDA IPC handles it opens on GPUs), and peers
copy each rank's heads straight to the rank(s) of theirs that hold them, whatever the two
engines' tensor-parallel sizes. Across hosts such a core's block server sends canonical blocks
(every KV head once) gathered piece by piece, and a tensor-parallel receiver splits what it
receives over its ranks (tcp; not ucxx or torch_dist, which move one cache's blocks).

A *streamed* export (`open_stream`, `extend_stream`) is registered while its prompt is
computed and grows by the blocks each step filled; only those are served, and a receiver pulls
them batch by batch (`start_load` per batch of a `KVSource.streamed`).

What the serving process needs to grant a pull — the cache file's name, the block server's
address — is fixed at start-up and reported in `CoreInfo`; what it needs per export (the
checksums) is the answer to `export`. Transports: `shm_peer.py` (same host: one copy out of the
sender's cache file on CPU, device to device through a CUDA IPC handle on GPU),
`tcp_blocks.py` (any host: streamed from and into the caches) and `ucx_blocks.py` (UCX through
ucxx, host or device memory, where the package is installed).
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pdmesh.kvstore.connector.blocks import (
    block_checksums,
    default_block_algo,
    on_device_of,
    receiving_stream,
)
from pdmesh.kvstore.connector.cache_file import SharedCache
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.cuda_ipc import share_with_peers, unshare
from pdmesh.kvstore.connector.dist_groups import PairGroups
from pdmesh.kvstore.connector.export_info import ExportInfo
from pdmesh.kvstore.connector.exports import Export, ExportRegistry
from pdmesh.kvstore.connector.grant_ledger import GrantLedger
from pdmesh.kvstore.connector.rank_caches import RankCaches
from pdmesh.kvstore.connector.shm_peer import ShmPeerTransport
from pdmesh.kvstore.connector.source import WORKER_BACKENDS, KVSource, check_params
from pdmesh.kvstore.transfer.checksum import ChecksumAlgo, parse_algo
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import KVBackendUnavailable, KVChecksumError
from pdmesh.kvstore.transfer.layout import DTYPE_NAMES

logger = logging.getLogger(__name__)

LOAD_THREADS = 2  # concurrent pulls per core (each may use several TCP connections)


class KVConnector:
    def __init__(self, config: KVConnectorConfig, cache: torch.Tensor,
                 cache_file: SharedCache | None, algo: ChecksumAlgo | None = None,
                 ranks: RankCaches | None = None, rank_files: tuple[str, ...] = (),
                 rank_ipcs: tuple[str, ...] = ()) -> None:
        """`ranks`: every rank's cache of a tensor-parallel core (`cache` is the first);
        `rank_files` the other ranks' cache file names (CPU), `rank_ipcs` every rank's CUDA
        IPC description (GPU), in rank order."""
        self.config = config
        self.cache = cache
        self.cache_file = cache_file
        self.ranks = ranks if ranks is not None else RankCaches((cache,))
        self.rank_files = rank_files
        self.algo = algo or default_block_algo(cache)
        self.exports = ExportRegistry()
        self.grants = GrantLedger(self.exports)  # one for every block server of this core
        self._shm = ShmPeerTransport(config.shm_dir)
        self._server = None
        self._loads = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="kv-load")
        self._dist_groups = PairGroups()  # torch_dist: a group per sender core, kept
        # The stream the engine's steps run on (this is built on the core's thread): a pull's
        # writes wait for what it queued when the pull began (`receiving_stream`).
        self._model_stream = (torch.cuda.current_stream(cache.device)
                              if cache.device.type == "cuda" else None)
        self.block_server_address = ""
        self._ucx = None
        self.ucx_address = ""  # the core's ucxx listener (`ucx_blocks.py`); empty: none
        # CUDA IPC: one description, or a tensor-parallel core's every rank's as a JSON list
        # (shared by the ranks themselves: engine/core/rank_cache_share.py)
        self._shared = (share_with_peers(cache) if cache.device.type == "cuda"
                        and not rank_ipcs and self.ranks.world == 1 else "")
        self.cache_ipc = json.dumps(list(rank_ipcs)) if rank_ipcs else self._shared

    def start(self) -> None:
        """Start the block server (when TCP is on) and the ucxx listener (when UCX is on and
        the package imports); their addresses go into `CoreInfo`."""
        if self.config.ucx and self.ranks.world == 1:  # one cache's blocks only
            self._start_ucx()
        if not self.config.tcp:
            return
        if not self.config.grant_secret:
            raise ValueError("a KV connector that serves blocks over TCP needs the grant key "
                             "its serving process signs pulls with (grant_secret)")
        from pdmesh.kvstore.connector.tcp_blocks import BlockServer

        self._server = BlockServer(self.cache, self.exports, self.config, self.grants,
                                   self.ranks)
        self.block_server_address = self._server.start()

    def _start_ucx(self) -> None:
        from pdmesh.kvstore.connector import ucx_blocks

        reason = ucx_blocks.unavailable_reason()
        if reason is not None:  # not offered: the serving process sees no ucxx address
            logger.info("no UCX block server: %s", reason)
            return
        if not self.config.grant_secret:
            raise ValueError("a KV connector that serves blocks over UCX needs the grant key "
                             "its serving process signs pulls with (grant_secret)")
        server = ucx_blocks.UcxBlockServer(self.cache, self.exports, self.config, self.grants)
        try:
            self.ucx_address = server.start()
        except Exception:  # a UCX that cannot listen here: the transport is not offered
            logger.warning("the UCX block server did not start", exc_info=True)
            return
        self._ucx = server

    @property
    def cache_file_name(self) -> str:
        """What peers map: the cache file's name; a tensor-parallel core's every rank's, in
        rank order, comma-separated."""
        if self.cache_file is None:
            return ""
        return ",".join((self.cache_file.name, *self.rank_files))

    # -- sender ---------------------------------------------------------------------------------
    def export(self, request_id: str, block_ids: list[int], num_tokens: int) -> ExportInfo:
        self.exports.add(Export(request_id, tuple(block_ids), num_tokens))
        return ExportInfo(self.ranks.checksums(self.algo, block_ids), str(self.algo))

    def open_stream(self, request_id: str, num_tokens: int) -> None:
        """A streamed export (its prefill just admitted): registered with no block ready."""
        self.exports.add(Export(request_id, (), num_tokens))

    def extend_stream(self, request_id: str, block_ids: list[int]) -> list[int]:
        """Checksum a streamed export's newly filled blocks, then serve them; their checksums.
        On a device cache the checksum waits for the steps that wrote the blocks (it reads
        them on the core's stream and answers host integers), so nothing is served early."""
        sums = self.ranks.checksums(self.algo, block_ids)
        self.exports.extend(request_id, block_ids)
        return sums

    def release(self, request_id: str) -> None:
        self.exports.remove(request_id)

    # -- receiver -------------------------------------------------------------------------------
    def check_source(self, source: KVSource) -> None:
        """Refuse a source whose blocks cannot be ours before anything is allocated."""
        ours = self.ranks.layout  # layers, block, heads (every rank's), head_dim
        dtype = DTYPE_NAMES.get(self.cache.dtype)
        if tuple(source.kv_shape) != ours or source.kv_dtype != dtype:
            raise ValueError(f"kv_source: layout {tuple(source.kv_shape)} {source.kv_dtype} "
                             f"does not match this engine's {ours} {dtype}")
        block_size = ours[1]
        if source.backend not in WORKER_BACKENDS:
            raise ValueError(f"kv_source: unknown transport {source.backend!r}")
        if self.ranks.world > 1 and source.backend not in ("shm", "tcp"):
            raise ValueError(f"kv_source: a tensor-parallel engine pulls over shm or tcp, not "
                             f"{source.backend!r}")
        expected = -(-source.num_tokens // block_size)
        count = len(source.block_checksums)  # a growing export's: those ready so far
        if count > expected or (count != expected and not source.streamed):
            raise ValueError(f"kv_source: {len(source.block_checksums)} block checksums for "
                             f"{source.num_tokens} tokens ({expected} blocks)")
        parse_algo(source.checksum_algo)

    def start_load(self, source: KVSource, first_block: int, dst_ids: list[int]
                   ) -> Future[int]:
        """`load` on a connector thread. The caller keeps `dst_ids` allocated (and out of the
        prefix cache) until the future is done, whatever happens to its request meanwhile."""
        return self._loads.submit(self._load_on_device, source, first_block, dst_ids)

    def _load_on_device(self, source: KVSource, first_block: int, dst_ids: list[int]) -> int:
        with on_device_of(self.cache), receiving_stream(self.cache, self._model_stream):
            return self.load(source, first_block, dst_ids)

    def load(self, source: KVSource, first_block: int, dst_ids: list[int]) -> int:
        """Pull export blocks [first_block, ...) into `dst_ids`; bytes moved. Raises a
        `KVTransferError` (the blocks' contents are then undefined: the caller frees them)."""
        if not dst_ids:
            return 0
        started = time.monotonic()
        algo = parse_algo(source.checksum_algo)
        if source.backend == "shm":  # the copy answers the checksums of what it wrote
            nbytes, actual = self._shm.load(source, first_block, self.ranks, dst_ids, algo)
        elif source.backend in ("tcp", "torch_dist"):
            from pdmesh.kvstore.connector.tcp_blocks import pull_blocks

            p = source.params
            check_params(p, ("address", "transfer", "grant", "mac"))
            nbytes = pull_blocks(
                p["address"], request_id=p.get("request", ""), transfer_id=p["transfer"],
                grant=p["grant"], mac=p["mac"], first_block=first_block, dst=self.cache,
                dst_ids=dst_ids, config=self.config,
                deadline=Deadline.after(max(source.deadline_s, 0.001)), via=source.backend,
                ranks=self.ranks, groups=self._dist_groups,
            )
            actual = self.ranks.checksums(algo, dst_ids)
        elif source.backend == "ucxx":
            from pdmesh.kvstore.connector import ucx_blocks

            p = source.params
            check_params(p, ("address", "transfer", "grant", "mac"))
            nbytes = ucx_blocks.pull_blocks(
                p["address"], request_id=p.get("request", ""), transfer_id=p["transfer"],
                grant=p["grant"], mac=p["mac"], first_block=first_block, dst=self.cache,
                dst_ids=dst_ids, config=self.config,
                deadline=Deadline.after(max(source.deadline_s, 0.001)))
            actual = block_checksums(algo, self.cache, dst_ids)
        else:
            raise KVBackendUnavailable(f"no worker transport {source.backend!r}")
        expected = source.block_checksums[first_block:first_block + len(dst_ids)]
        bad = [first_block + i for i, (a, e) in enumerate(zip(actual, expected, strict=True))
               if a != e]
        if bad:
            raise KVChecksumError(f"{len(bad)} of {len(dst_ids)} pulled blocks fail their "
                                  f"{source.checksum_algo} checksum (first: block {bad[0]})")
        logger.debug("pulled %d blocks (%d bytes) over %s in %.1f ms", len(dst_ids), nbytes,
                     source.backend, (time.monotonic() - started) * 1e3)
        return nbytes

    def close(self) -> None:
        self._loads.shutdown(wait=True)  # every load is bounded by its deadline
        self._dist_groups.close()
        if self._server is not None:
            self._server.close()
        if self._ucx is not None:
            self._ucx.close()
        self._shm.close()
        unshare(self._shared)  # the cache may go back to torch's pool once the engine drops it
        if self.cache_file is not None:
            self.cache_file.close()
