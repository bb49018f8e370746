"""Same host: copy blocks straight out of the sender core's cache.

On CPU the sender's StartTransfer reply names its cache file and the export's block ids; the
receiving core maps the file read-only (`cache_file.PeerCaches`, kept mapped across pulls) and
copies the blocks it lacks into its own cache, one strided copy per run of block ids: one
copy of each byte on the host, and no socket. On GPU the reply carries a CUDA IPC handle of
the sender's cache instead (`cuda_ipc.py`) and the copy is device to device.
"""

from __future__ import annotations

import torch

from pdmesh.kvstore.connector.blocks import block_nbytes, copy_blocks_checked
from pdmesh.kvstore.connector.cache_file import PeerCaches
from pdmesh.kvstore.connector.cuda_ipc import PeerDeviceCaches
from pdmesh.kvstore.connector.source import KVSource, check_params, decode_blocks
from pdmesh.kvstore.transfer.checksum import ChecksumAlgo
from pdmesh.kvstore.transfer.errors import KVWireError
from pdmesh.kvstore.transfer.layout import DTYPES_BY_NAME

PARAMS = ("cache", "num_blocks", "blocks")


class ShmPeerTransport:
    name = "shm"

    def __init__(self, shm_dir: str) -> None:
        self.peers = PeerCaches(shm_dir)
        self.device_peers = PeerDeviceCaches()

    def load(self, source: KVSource, first_block: int, dst: torch.Tensor, dst_ids: list[int],
             algo: ChecksumAlgo) -> tuple[int, list[int]]:
        """Copy export blocks [first_block, first_block + len(dst_ids)) into dst_ids; the bytes
        moved and each copied block's `algo` checksum, as it landed in `dst`."""
        layers, block_size, heads, head_dim = source.kv_shape
        dtype = DTYPES_BY_NAME[source.kv_dtype]
        if "cuda_ipc" in source.params:
            check_params(source.params, ("cuda_ipc", "blocks"))
            peer = self.device_peers.get(source.params["cuda_ipc"])
            num_cache_blocks = int(peer.shape[2])
            if (tuple(peer.shape) != (layers, 2, num_cache_blocks, block_size, heads, head_dim)
                    or peer.dtype != dtype):
                raise KVWireError("shm source: the peer's device cache has another layout")
        else:
            check_params(source.params, PARAMS)
            try:
                num_cache_blocks = int(source.params["num_blocks"])
            except ValueError:
                raise KVWireError("shm source: num_blocks is not an integer") from None
            shape = (layers, 2, num_cache_blocks, block_size, heads, head_dim)
            peer = self.peers.get(source.params["cache"], shape, dtype)
        src_ids = decode_blocks(source.params["blocks"], num_cache_blocks)
        wanted = src_ids[first_block:first_block + len(dst_ids)]
        if len(wanted) != len(dst_ids):
            raise KVWireError(f"shm source: the export has {len(src_ids)} blocks, "
                              f"{first_block + len(dst_ids)} wanted")
        sums = copy_blocks_checked(algo, dst, dst_ids, peer, wanted)
        return len(dst_ids) * block_nbytes(dst), sums

    def close(self) -> None:
        self.peers.clear()
        self.device_peers.clear()
