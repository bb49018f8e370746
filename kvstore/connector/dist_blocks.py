"""torch.distributed block transport run by the engine cores: NCCL between GPU caches, gloo on
CPU (and in the tests), for hosts whose GPUs talk over NVLink or a fabric NCCL knows.

A pull starts like a TCP pull, on the sender core's block server (`tcp_blocks.py`), whose
admission it shares: the signed one-time grant, the layout, the range. With `via="torch_dist"`
the server answers with the port of a fresh two-rank rendezvous (`TCPStore`) instead of the
bytes; both cores build a process group of their own on it (the sender rank 0, the receiver
rank 1: a group per pull, never entangled with another pair's collectives, torn down after),
the sender gathers the requested blocks on its device (an `index_select` per message) and sends
them in messages of at most `CHUNK_BYTES` (its reply names the blocks per message), the
receiver takes each into one staging tensor on its device and copies each run into its cache
blocks: the device temporaries are a chunk each side, not the whole pull (a long prompt's KV
is gigabytes on a GPU, beside a cache sized to fill the device). The block server's
connection stays open to the end: the receiver says it has everything before the sender tears
the group down.

Collectives cannot be interrupted: the group's timeout (the pull's deadline) bounds them.
There is no TLS on this path (a sender with TLS offers tcp instead).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import socket

import torch

from pdmesh.kvstore.connector.blocks import runs
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import KVTransferTimeout, KVWireError

DONE = b"\x01"
CHUNK_BYTES = 64 << 20
"""At most this many bytes of blocks per message (at least one block)."""


def blocks_per_message(block_bytes: int) -> int:
    return max(1, CHUNK_BYTES // max(block_bytes, 1))


def available() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_gloo_available()


def group_kind(sender: torch.device, receiver_device: str) -> str:
    """NCCL when both caches are on GPUs (and NCCL is built in), else gloo over host memory."""
    nccl = torch.distributed.is_nccl_available() if torch.distributed.is_available() else False
    return "nccl" if sender.type == "cuda" and receiver_device == "cuda" and nccl else "gloo"


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.05))


def process_group(store: torch.distributed.Store, rank: int, kind: str, host: str,
                  seconds: float) -> torch.distributed.ProcessGroup:
    """A two-rank group of its own on `store` (never the default group: no entanglement)."""
    dist = torch.distributed
    if kind == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _timeout(seconds)
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = _timeout(seconds)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def settle(kind: str, tensor: torch.Tensor) -> None:
    """Block this thread until the group's transfer of `tensor` (and what the current stream
    queued after it) has finished on the device. NCCL's `Work.wait()` only makes the current
    CUDA stream wait for the transfer and returns at once: a side that then said "done", or
    tore its group down (which aborts a transfer still in flight), would race the bytes.
    Gloo's wait already returns with the bytes in place."""
    if kind == "nccl" and tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def _release(group: torch.distributed.ProcessGroup) -> None:
    shutdown = getattr(group, "shutdown", None) or getattr(group, "abort", None)
    if callable(shutdown):
        with contextlib.suppress(RuntimeError):  # already torn down by a failed collective
            shutdown()


def open_store(config: KVConnectorConfig, seconds: float) -> torch.distributed.TCPStore:
    """The sender's side of the rendezvous (an ephemeral port on the block server's host)."""
    return torch.distributed.TCPStore(config.tcp_host, 0, 2, True, timeout=_timeout(seconds),
                                      wait_for_workers=False)


def send_blocks(conn: socket.socket, store: torch.distributed.TCPStore, cache: torch.Tensor,
                ids: tuple[int, ...], kind: str, config: KVConnectorConfig,
                per_message: int) -> None:
    """Sender (a block-server thread, after the reply named the store): the blocks in
    messages of `per_message` blocks, then wait for the receiver's word that it is done
    before tearing down."""
    seconds = config.io_timeout_s
    group = process_group(store, 0, kind, config.tcp_advertise_host or config.tcp_host, seconds)
    try:
        for tag, start in enumerate(range(0, len(ids), per_message)):
            index = torch.tensor(list(ids[start:start + per_message]), device=cache.device)
            payload = cache.index_select(2, index)  # one gather on the sender's device
            if kind == "gloo" and payload.device.type != "cpu":
                payload = payload.cpu()
            group.send([payload.reshape(-1).view(torch.uint8)], 1, tag).wait(
                _timeout(seconds))
            settle(kind, payload)
        conn.settimeout(seconds)
        conn.recv(1)  # the receiver has it (or went away): the group may go
    finally:
        _release(group)


def receive_blocks(sock: socket.socket, host: str, port: int, kind: str, dst: torch.Tensor,
                   dst_ids: list[int], deadline: Deadline, per_message: int) -> int:
    """Receiver (the pulling core, on the block server's connection): join the group, take
    each message of `per_message` blocks into one staging tensor and copy its runs into the
    cache, say done."""
    seconds = deadline.remaining()
    if seconds <= 0:
        raise KVTransferTimeout("the pull's deadline passed before its group formed")
    store = torch.distributed.TCPStore(host, port, 2, False, timeout=_timeout(seconds))
    local = sock.getsockname()[0]  # the interface that reaches the sender
    group = process_group(store, 1, kind, local, seconds)
    try:
        block_shape = (dst.shape[0], 2, 1, *dst.shape[3:])
        per_block = math.prod(block_shape)
        device = dst.device if kind == "nccl" else torch.device("cpu")
        flat = torch.empty(min(per_message, len(dst_ids)) * per_block, dtype=dst.dtype,
                           device=device)
        for tag, start in enumerate(range(0, len(dst_ids), per_message)):
            ids = dst_ids[start:start + per_message]
            # (NCCL orders a receive after the current stream's copies out of the last one)
            staging = flat[:len(ids) * per_block].view(*block_shape[:2], len(ids),
                                                       *block_shape[3:])
            try:
                group.recv([staging.reshape(-1).view(torch.uint8)], 0, tag).wait(
                    _timeout(deadline.remaining()))
            except RuntimeError as exc:
                if deadline.remaining() <= 0:
                    raise KVTransferTimeout(f"torch_dist pull timed out: {exc}") from None
                raise KVWireError(f"torch_dist pull failed: {exc}") from None
            for s, d, n in runs(range(len(ids)), ids):
                dst[:, :, d:d + n].copy_(staging[:, :, s:s + n])
        settle(kind, dst)  # the blocks are in the cache before the sender may let go
        sock.sendall(DONE)
        return len(dst_ids) * per_block * dst.element_size()
    finally:
        _release(group)
