"""Same host, GPU: a CUDA IPC handle of the sender core's cache, so a peer core on the node
copies blocks device to device (the GPU form of `cache_file.py`).

The sender shares its cache's CUDA allocation once at start-up (`share`: the handle and the
reference-count slot torch's IPC protocol keeps, as plain strings: never pickled); the handle
travels in `CoreInfo` and the `shm` plane's StartTransfer reply. A receiver opens it once
(`PeerDeviceCaches`) and copies runs of blocks from the mapping into its own cache with
`copy_` (peer-to-peer where the GPUs allow it, through the host otherwise). The device is
named by its UUID: two processes with different `CUDA_VISIBLE_DEVICES` number GPUs
differently.

CUDA cannot open an IPC handle in the process that made it (torch's own sharing keeps a cache
for that case), so a description this process shared opens as its own tensor: two engines in
one process (the tests' in-thread cores, an `LLM` beside another) pull from each other too.

Never exercised without a GPU: everything here is guarded by `torch.cuda.is_available()` and
a failure to share or open falls back to TCP (the sender offers no `shm` without a handle; a
receiver that cannot open one fails the pull, which recomputes).
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch

from pdmesh.kvstore.connector.cache_file import MAX_PEERS
from pdmesh.kvstore.transfer.errors import KVBackendUnavailable, KVWireError

logger = logging.getLogger(__name__)

_OWN: dict[tuple[str, int], weakref.ref[torch.Tensor]] = {}
"""The caches this process shared, by (handle, offset): opening one of them is a no-op."""
_OWN_LOCK = threading.Lock()

_FIELDS = ("device_uuid", "handle", "size", "offset", "ref_handle", "ref_offset", "event",
           "event_sync", "shape", "dtype")


def share(cache: torch.Tensor) -> str:
    """The IPC description of a CUDA cache (JSON), or "" when it cannot be shared."""
    if cache.device.type != "cuda" or not cache.is_contiguous() or cache.storage_offset():
        return ""
    try:
        storage = cache.untyped_storage()
        (device, handle, size, offset, ref_handle, ref_offset, event,
         event_sync) = storage._share_cuda_()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except Exception as exc:  # MIG slices, drivers without IPC: TCP it is
        logger.warning("the KV cache cannot be shared over CUDA IPC (%s); peers use tcp", exc)
        return ""
    with _OWN_LOCK:
        _OWN[(bytes(handle).hex(), int(offset))] = weakref.ref(cache)
    return json.dumps({
        "device_uuid": uuid, "handle": bytes(handle).hex(), "size": int(size),
        "offset": int(offset), "ref_handle": bytes(ref_handle).hex(),
        "ref_offset": int(ref_offset), "event": bytes(event).hex() if event else "",
        "event_sync": bool(event_sync), "shape": list(cache.shape),
        "dtype": str(cache.dtype).removeprefix("torch."),
    })


def _local_device(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise KVBackendUnavailable(f"the peer's GPU {uuid} is not visible to this process")


def open_peer(description: str) -> torch.Tensor:
    """Map a peer's shared cache into this process (read only by convention)."""
    if not torch.cuda.is_available():
        raise KVBackendUnavailable("a CUDA IPC source needs CUDA in this process")
    try:
        meta: dict[str, Any] = json.loads(description)
        if not isinstance(meta, dict) or any(f not in meta for f in _FIELDS):
            raise ValueError("fields missing")
        shape = [int(d) for d in meta["shape"]]
        handle, offset = str(meta["handle"]), int(meta["offset"])
        dtype = getattr(torch, str(meta["dtype"]))
        if not isinstance(dtype, torch.dtype) or len(shape) != 6:
            raise ValueError("bad layout")
    except (ValueError, TypeError) as exc:
        raise KVWireError(f"malformed CUDA IPC description: {exc}") from None
    own = _own(handle, offset)
    if own is not None:  # shared by this process: CUDA would refuse to open it here
        if list(own.shape) != shape or own.dtype != dtype:
            raise KVWireError("the CUDA IPC description does not match the cache it names")
        return own
    device = _local_device(str(meta["device_uuid"]))
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device, bytes.fromhex(meta["handle"]), int(meta["size"]), int(meta["offset"]),
        bytes.fromhex(meta["ref_handle"]), int(meta["ref_offset"]),
        bytes.fromhex(meta["event"]) if meta["event"] else b"", bool(meta["event_sync"]))
    tensor = torch.empty(0, dtype=dtype, device=f"cuda:{device}")
    tensor.set_(storage, 0, shape)
    if tensor.numel() * tensor.element_size() > storage.nbytes():
        raise KVWireError("the CUDA IPC allocation is smaller than its layout")
    return tensor


def _own(handle: str, offset: int) -> torch.Tensor | None:
    with _OWN_LOCK:
        ref = _OWN.get((handle, offset))
        tensor = ref() if ref is not None else None
        if ref is not None and tensor is None:  # freed: its allocation may be another's now
            del _OWN[(handle, offset)]
        return tensor


class PeerDeviceCaches:
    """Peer caches opened on first use and kept, up to `MAX_PEERS`, most recent first (each
    mapping keeps its peer's whole allocation alive on that GPU, even after the peer exited,
    so a restarted peer's old mapping goes once newer ones push it out). Opened under the lock:
    two pulls from a new peer share one mapping (each open takes a slot of torch's IPC
    reference count)."""

    def __init__(self) -> None:
        self._maps: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, description: str) -> torch.Tensor:
        with self._lock:
            tensor = self._maps.get(description)
            if tensor is None:
                tensor = open_peer(description)
                self._maps[description] = tensor
                while len(self._maps) > MAX_PEERS:
                    self._maps.popitem(last=False)
            self._maps.move_to_end(description)
            return tensor

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()
