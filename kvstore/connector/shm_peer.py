"""Same host: copy blocks straight out of the sender core's cache.

On CPU the sender's StartTransfer reply names its cache file and the export's block ids; the
receiving core maps the file read-only (`cache_file.PeerCaches`, kept mapped across pulls) and
copies the blocks it lacks into its own cache, one strided copy per run of block ids: one
copy of each byte on the host, and no socket. On GPU the reply carries a CUDA IPC handle of
the sender's cache instead (`cuda_ipc.py`) and the copy is device to device.

A tensor-parallel sender names one file per rank (`cache`: comma-separated, in rank order);
each of the receiver's ranks gets its KV heads straight from the sender's rank(s) that hold
them (`rank_caches.copy_across`), whatever the two engines' tensor-parallel sizes.
"""

from __future__ import annotations

import json

import torch

from pdmesh.engine.worker.parallel.sharding import ModelShard, check_shardable
from pdmesh.kvstore.connector.blocks import block_nbytes
from pdmesh.kvstore.connector.cache_file import PeerCaches
from pdmesh.kvstore.connector.cuda_ipc import PeerDeviceCaches
from pdmesh.kvstore.connector.rank_caches import RankCaches, copy_across
from pdmesh.kvstore.connector.source import KVSource, check_params, decode_blocks
from pdmesh.kvstore.transfer.checksum import ChecksumAlgo
from pdmesh.kvstore.transfer.errors import KVWireError
from pdmesh.kvstore.transfer.layout import DTYPES_BY_NAME

PARAMS = ("cache", "num_blocks", "blocks")
MAX_RANKS = 1024  # as tensor_parallel_size


class ShmPeerTransport:
    name = "shm"

    def __init__(self, shm_dir: str) -> None:
        self.peers = PeerCaches(shm_dir)
        self.device_peers = PeerDeviceCaches()

    def load(self, source: KVSource, first_block: int, dst: RankCaches, dst_ids: list[int],
             algo: ChecksumAlgo) -> tuple[int, list[int]]:
        """Copy export blocks [first_block, first_block + len(dst_ids)) into dst_ids of every
        rank of `dst`; the bytes moved and each copied block's `algo` checksum (canonical), as
        it landed."""
        layers, block_size, heads, head_dim = source.kv_shape
        dtype = DTYPES_BY_NAME[source.kv_dtype]
        if "cuda_ipc" in source.params:
            check_params(source.params, ("cuda_ipc", "blocks"))
            descriptions = ipc_descriptions(source.params["cuda_ipc"])
            rank_heads = sender_heads(dst, len(descriptions), heads)  # before opening any
            with self.device_peers.opened(descriptions, dst.first.device) as peers:
                src = device_ranks(peers, dst, (layers, block_size, head_dim), rank_heads,
                                   dtype)
                return _copy(source, first_block, dst, dst_ids, src, algo)
        check_params(source.params, PARAMS)
        try:
            num_cache_blocks = int(source.params["num_blocks"])
        except ValueError:
            raise KVWireError("shm source: num_blocks is not an integer") from None
        src = self._peer_ranks(source.params["cache"].split(","), dst,
                               (layers, 2, num_cache_blocks, block_size, heads, head_dim), dtype)
        return _copy(source, first_block, dst, dst_ids, src, algo)

    def _peer_ranks(self, names: list[str], ours: RankCaches, whole: tuple[int, ...],
                    dtype: torch.dtype) -> RankCaches:
        """The sender's rank caches, mapped: rank r's file holds rank r's KV heads of the
        model (`whole` is the layout of one rank holding all of them)."""
        heads = sender_heads(ours, len(names), whole[4])
        caches = [self.peers.get(name, (*whole[:4], h, whole[5]), dtype)
                  for name, h in zip(names, heads, strict=True)]
        return RankCaches(tuple(caches), ours.shape if len(names) > 1 else None)

    def close(self) -> None:
        self.peers.clear()
        self.device_peers.clear()


def _copy(source: KVSource, first_block: int, dst: RankCaches, dst_ids: list[int],
          src: RankCaches, algo: ChecksumAlgo) -> tuple[int, list[int]]:
    """Export blocks [first_block, first_block + len(dst_ids)) of `src` into `dst_ids`."""
    src_ids = decode_blocks(source.params["blocks"], int(src.first.shape[2]))
    wanted = src_ids[first_block:first_block + len(dst_ids)]
    if len(wanted) != len(dst_ids):
        raise KVWireError(f"shm source: the export has {len(src_ids)} blocks, "
                          f"{first_block + len(dst_ids)} wanted")
    sums = copy_across(algo, dst, dst_ids, src, wanted)
    return sum(len(dst_ids) * block_nbytes(c) for c in dst.caches), sums


def ipc_descriptions(text: str) -> list[str]:
    """One IPC description, or a tensor-parallel sender's JSON list of every rank's."""
    if not text.startswith("["):
        return [text]
    try:
        descriptions = json.loads(text)
    except ValueError:
        raise KVWireError("shm source: malformed list of CUDA IPC handles") from None
    if (not isinstance(descriptions, list) or not 1 <= len(descriptions) <= MAX_RANKS
            or not all(isinstance(d, str) for d in descriptions)):
        raise KVWireError("shm source: malformed list of CUDA IPC handles")
    return descriptions


def device_ranks(peers: list[torch.Tensor], ours: RankCaches, layout: tuple[int, int, int],
                 rank_heads: list[int], dtype: torch.dtype) -> RankCaches:
    """The sender's opened device cache(s), each checked against its rank's layout
    (layers, block size, head dim; `rank_heads`: the KV heads each rank holds)."""
    layers, block_size, head_dim = layout
    for peer, heads in zip(peers, rank_heads, strict=True):
        expected = (layers, 2, int(peer.shape[2]), block_size, heads, head_dim)
        if (tuple(peer.shape) != expected or peer.dtype != dtype
                or peer.shape[2] != peers[0].shape[2]):
            raise KVWireError("shm source: the peer's device cache has another layout")
    return RankCaches(tuple(peers), ours.shape if len(peers) > 1 else None)


def sender_heads(ours: RankCaches, world: int, num_kv_heads: int) -> list[int]:
    """The KV heads each of a `world`-rank sender's caches holds of this (same) model;
    KVWireError for a layout this side cannot place."""
    if world == 1:
        return [num_kv_heads]
    if not 1 <= world <= MAX_RANKS or ours.shape is None:
        raise KVWireError(f"shm source: {world} rank caches this engine cannot place")
    try:
        check_shardable(ours.shape, world)
    except ValueError as exc:
        raise KVWireError(f"shm source: {exc}") from None
    return [ModelShard.of(ours.shape, r, world).kv_heads.size for r in range(world)]
