"""torch.distributed block transport run by the engine cores: NCCL between GPU caches, gloo on
CPU (and in the tests), for hosts whose GPUs talk over NVLink or a fabric NCCL knows.

A pull starts like a TCP pull, on the sender core's block server (`tcp_blocks.py`), whose
admission it shares: the signed one-time grant, the layout, the range. With `via="torch_dist"`
the server answers with the process group to use instead of the bytes: the one the two cores
already keep for each other when the receiver named it (`dist_groups.py`: a group per
sender–receiver pair, made on the pair's first pull, torn down on failure), else the port of
a fresh two-rank rendezvous (`TCPStore`) on which both build one (the sender rank 0, the
receiver rank 1: never entangled with another pair's collectives). The sender gathers the
requested blocks on its device (an `index_select` per message) and sends them in messages of
at most `CHUNK_BYTES` (its reply names the blocks per message); the receiver takes each into
one staging tensor on its device and copies each run into its cache blocks: the device
temporaries are a chunk each side, not the whole pull (a long prompt's KV is gigabytes on a
GPU, beside a cache sized to fill the device). The block server's connection stays open to
the end: the receiver says it has everything before the sender lets the group go (back to its
registry, or torn down), and the sender says when a kept group is back in its registry, so
the receiver's next pull cannot name it before.

The reply's reason field: "port kind per_message group" (port 0: the kept group named; a
receiver that asked for no kept group gets the first three fields, as before pair groups).
Collectives cannot be interrupted: each wait is bounded by the pull's deadline and the group's
own timeout by `io_timeout_s`. There is no TLS on this path (a sender with TLS offers tcp
instead).
"""

from __future__ import annotations

import datetime
import math
import socket
from collections.abc import Callable

import torch

from pdmesh.kvstore.connector.blocks import block_nbytes, device_uuid, runs
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.dist_groups import PairGroup, PairGroups, new_group_id
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


def group_kind(sender: torch.device, receiver_device: str, receiver_gpu: str = "") -> str:
    """NCCL when the caches are on two GPUs (and NCCL is built in), else gloo over host
    memory."""
    nccl = torch.distributed.is_nccl_available() if torch.distributed.is_available() else False
    apart = gpus_apart(sender.type, device_uuid(sender), receiver_device, receiver_gpu)
    return "nccl" if nccl and apart else "gloo"


def gpus_apart(sender_type: str, sender_gpu: str, receiver_type: str, receiver_gpu: str) -> bool:
    """Both caches on GPUs, and not one GPU: NCCL refuses two ranks on one device (a prefill
    and a decode engine sharing a GPU), where gloo through the host still moves the blocks.
    A receiver that does not name its GPU (an older one) is taken to be on another."""
    if sender_type != "cuda" or receiver_type != "cuda":
        return False
    return not receiver_gpu or receiver_gpu != sender_gpu


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


def open_store(config: KVConnectorConfig, seconds: float) -> torch.distributed.TCPStore:
    """The sender's side of the rendezvous (an ephemeral port on the block server's host)."""
    return torch.distributed.TCPStore(config.tcp_host, 0, 2, True, timeout=_timeout(seconds),
                                      wait_for_workers=False)


def serve_pull(conn: socket.socket, answer: Callable[[str], None], groups: PairGroups,
               requested: str, keep: bool, cache: torch.Tensor, ids: tuple[int, ...],
               receiver_device: str, receiver_gpu: str, config: KVConnectorConfig) -> None:
    """Sender (a block-server thread, the pull admitted): `answer` with the group to use, the
    kept one the receiver named (`requested`) or a new rendezvous (kept after the pull when
    the receiver asks to `keep` it), then send the blocks over it."""
    kind = group_kind(cache.device, receiver_device, receiver_gpu)
    per_message = blocks_per_message(block_nbytes(cache))
    pair = groups.take(requested) if requested else None
    if pair is not None and pair.kind != kind:
        pair.close()
        pair = None
    ok = False
    try:
        if pair is None:
            store = open_store(config, config.io_timeout_s)
            group_id = new_group_id() if keep else ""
            answer(f"{store.port} {kind} {per_message}" + (f" {group_id}" if keep else ""))
            host = config.tcp_advertise_host or config.tcp_host
            pair = PairGroup(group_id, kind,
                             process_group(store, 0, kind, host, config.io_timeout_s), store)
        else:
            answer(f"0 {kind} {per_message} {pair.group_id}")
        send_blocks(conn, pair.group, cache, ids, kind, config, per_message)
        ok = True
    finally:
        if pair is not None:
            if ok and pair.group_id:
                groups.give_back(pair.group_id, pair)
            else:
                pair.close()
    if pair.group_id:  # kept: the receiver's next pull may name it from now on
        conn.sendall(DONE)


def send_blocks(conn: socket.socket, group: torch.distributed.ProcessGroup, cache: torch.Tensor,
                ids: tuple[int, ...], kind: str, config: KVConnectorConfig,
                per_message: int) -> None:
    """Sender: the blocks in messages of `per_message` blocks, then the receiver's word that
    it has them all (the group is not let go before: a transfer in flight would be cut)."""
    seconds = config.io_timeout_s
    for tag, start in enumerate(range(0, len(ids), per_message)):
        index = torch.tensor(list(ids[start:start + per_message]), device=cache.device)
        payload = cache.index_select(2, index)  # one gather on the sender's device
        if kind == "gloo" and payload.device.type != "cpu":
            payload = payload.cpu()
        group.send([payload.reshape(-1).view(torch.uint8)], 1, tag).wait(_timeout(seconds))
        settle(kind, payload)
    conn.settimeout(seconds)
    if conn.recv(1) != DONE:
        raise KVWireError("the receiver went away before it said it had the blocks")


def receive_pull(sock: socket.socket, host: str, reason: str, payload: int, held: PairGroup | None,
                 groups: PairGroups | None, key: str, dst: torch.Tensor, dst_ids: list[int],
                 deadline: Deadline, config: KVConnectorConfig) -> int:
    """Receiver (the pulling core, on the block server's connection, its answer `reason`
    read): join the new group or reuse the kept one it names, take the blocks. `held` (the
    group this side kept for the sender, taken for this pull) is given back to `groups` under
    `key` after a pull that ended well, or closed."""
    pair = held
    ok = False
    try:
        fields = reason.split(" ")
        if len(fields) == 2:  # a sender from before messages were bounded: one message
            fields.append(str(len(dst_ids)))
        if len(fields) == 3:  # a sender from before pair groups: a group for this pull
            fields.append("")
        if (len(fields) != 4 or payload != len(dst_ids) * block_nbytes(dst)
                or not fields[0].isdigit() or fields[1] not in ("gloo", "nccl")
                or not fields[2].isdigit() or int(fields[2]) < 1 or len(fields[3]) > 64):
            raise KVWireError("the block server's rendezvous reply is malformed")
        port, kind, per_message, group_id = int(fields[0]), fields[1], int(fields[2]), fields[3]
        if port == 0:
            if pair is None or not group_id or (pair.group_id, pair.kind) != (group_id, kind):
                raise KVWireError("the block server named a group this side does not keep")
        else:
            if pair is not None:  # the sender no longer keeps it: a new one replaces it
                pair.close()
            pair = None
            seconds = deadline.remaining()
            if seconds <= 0:
                raise KVTransferTimeout("the pull's deadline passed before its group formed")
            store = torch.distributed.TCPStore(host, port, 2, False, timeout=_timeout(seconds))
            local = sock.getsockname()[0]  # the interface that reaches the sender
            pair = PairGroup(group_id, kind,
                             process_group(store, 1, kind, local, config.io_timeout_s), store)
        nbytes = receive_blocks(sock, pair.group, kind, dst, dst_ids, deadline, per_message)
        if group_id:  # the sender has it back in its registry before this side names it again
            sock.settimeout(max(min(config.io_timeout_s, deadline.remaining()), 0.05))
            if sock.recv(1) != DONE:
                raise KVWireError("the block server did not say it kept the group")
        ok = True
        return nbytes
    finally:
        if pair is not None:
            if ok and pair.group_id and groups is not None:
                groups.give_back(key, pair)
            else:
                pair.close()


def receive_blocks(sock: socket.socket, group: torch.distributed.ProcessGroup, kind: str,
                   dst: torch.Tensor, dst_ids: list[int], deadline: Deadline,
                   per_message: int) -> int:
    """Receiver: take each message of `per_message` blocks into one staging tensor and copy
    its runs into the cache, say done."""
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
