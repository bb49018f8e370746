"""The control-plane halves of the engine core's own transports (`kvstore/connector/`).

A sender whose engine core lends its blocks itself publishes *exports* (block ids and
per-block checksums, no bytes). When a receiver starts a transfer, these planes answer with
what the receiver's core needs to pull the blocks straight from the sender's core, and touch
no KV byte themselves:

* `shm` (same host, CPU): the core's cache file name and the export's block ids. Served only
  to a receiver that proves it shares this host's shm directory (`hostid.HostChallenge`);
* `tcp` (any host): the core's block server address and a pull signed with the key this
  process shares with its core (`connector/grant_mac.py`), bound to the one-time grant;
* `torch_dist` (NCCL between GPUs, gloo on CPU): the same, the bytes then going over a
  process group the two cores form for the pull (`connector/dist_blocks.py`).

Torch-free: the serving process imports this module, and its core moves the bytes.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from pdmesh.kvstore.connector import grant_mac
from pdmesh.kvstore.connector.source import encode_blocks
from pdmesh.kvstore.transfer.backends.availability import dist_available
from pdmesh.kvstore.transfer.backends.base import DataPlaneServer
from pdmesh.kvstore.transfer.backends.hostid import HostChallenge
from pdmesh.kvstore.transfer.errors import KVTransferError, KVTransferNotFound
from pdmesh.kvstore.transfer.lease import Grant
from pdmesh.leftovers import sweep_kv_segments


@dataclass(frozen=True)
class CoreCache:
    """The sender core's fixed facts (its `CoreInfo`) and the key it checks pulls with."""

    cache_file: str       # empty: not shared (a device cache)
    num_blocks: int
    block_server: str     # host:port; empty: off
    grant_key: str
    cache_ipc: str = ""   # a device cache's CUDA IPC description; empty: none
    ucx_server: str = ""  # host:port of the core's ucxx listener; empty: off

    def backends(self) -> tuple[str, ...]:
        return core_backends(self.cache_file, self.block_server, self.cache_ipc,
                             self.ucx_server)


def core_backends(cache_file: str, block_server: str, cache_ipc: str = "",
                  ucx_server: str = "") -> tuple[str, ...]:
    """The transports an engine core with these `CoreInfo` facts runs itself: shm needs a
    shared cache (a file on CPU, a CUDA IPC handle on GPU), tcp its block server, ucxx its
    ucxx listener (`ucx_plane.py`; started only where the package imports)."""
    names = ["shm"] if cache_file or cache_ipc else []
    if block_server:
        names.append("tcp")
        if dist_available():
            names.append("torch_dist")
    if ucx_server:
        names.append("ucxx")
    return tuple(names)


class Exports:
    """Block ids of published exports by transfer id (the planes' only per-transfer state)."""

    def __init__(self) -> None:
        self._blocks: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def add(self, transfer_id: str, block_ids: tuple[int, ...]) -> None:
        with self._lock:
            self._blocks[transfer_id] = block_ids

    def extend(self, transfer_id: str, block_ids: list[int]) -> None:
        """A streamed export's newly ready blocks (an shm StartTransfer answers those
        ready by then; the rest reach the receiver through WatchTransfer)."""
        with self._lock:
            if transfer_id in self._blocks:
                self._blocks[transfer_id] = (*self._blocks[transfer_id], *block_ids)

    def pop(self, transfer_id: str) -> None:
        with self._lock:
            self._blocks.pop(transfer_id, None)

    def get(self, transfer_id: str) -> tuple[int, ...]:
        with self._lock:
            blocks = self._blocks.get(transfer_id)
        if blocks is None:
            raise KVTransferNotFound("no export for this transfer", transfer_id=transfer_id)
        return blocks


class CacheFilePlane(DataPlaneServer):
    name = "shm"

    def __init__(self, core: CoreCache, exports: Exports, shm_dir: str) -> None:
        self.core, self.exports = core, exports
        directory = os.path.realpath(shm_dir)
        if not os.path.isdir(directory):
            raise KVTransferError(f"shm directory {directory} does not exist")
        sweep_kv_segments(directory)  # cache files and segments of dead services
        # A device cache's IPC handle opens only in this PID namespace (hostid.py).
        self.challenge = HostChallenge(directory, same_pid_namespace=bool(core.cache_ipc))

    def refusal(self, transfer_id: str, receiver_proof: str) -> str | None:
        return self.challenge.refusal(transfer_id, receiver_proof)

    async def prepare(self, grant: Grant) -> dict[str, str]:
        blocks = self.exports.get(grant.transfer_id)
        if self.core.cache_ipc:  # a device cache: copied device to device on the node
            return {"cuda_ipc": self.core.cache_ipc, "blocks": encode_blocks(blocks)}
        return {"cache": self.core.cache_file, "num_blocks": str(self.core.num_blocks),
                "blocks": encode_blocks(blocks)}

    async def close(self) -> None:
        self.challenge.close()


class BlockServerPlane(DataPlaneServer):
    name = "tcp"

    def __init__(self, core: CoreCache, exports: Exports, tls: bool = False) -> None:
        self.core, self.exports, self.tls = core, exports, tls

    async def prepare(self, grant: Grant) -> dict[str, str]:
        self.exports.get(grant.transfer_id)  # published here, not only known to the table
        mac = grant_mac.sign(self.core.grant_key, grant.request_id, grant.transfer_id,
                             grant.token)
        params = {"address": self.core.block_server, "request": grant.request_id,
                  "transfer": grant.transfer_id, "grant": grant.token, "mac": mac}
        if self.tls:
            params["tls"] = "1"  # the block server speaks TLS only
        return params


class GroupPlane(BlockServerPlane):
    """`torch_dist`: admitted by the same block server, the bytes over a process group."""

    name = "torch_dist"
