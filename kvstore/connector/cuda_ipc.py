"""Same host, GPU: a CUDA IPC handle of the sender core's cache, so a peer core on the node
copies blocks device to device (the GPU form of `cache_file.py`).

The sender shares its cache's CUDA allocation once at start-up (`share`: the handle and the
reference-count slot torch's IPC protocol keeps, as plain strings: never pickled); the handle
travels in `CoreInfo` and the `shm` plane's StartTransfer reply. A receiver opens it once
(`PeerDeviceCaches`) and copies runs of blocks from the mapping into its own cache with
`copy_`. The device is named by its UUID: two processes with different `CUDA_VISIBLE_DEVICES`
number GPUs differently.

Where the handle is opened matters on a node of several GPUs. torch's opener makes the
sender's GPU current, which creates a CUDA context there in the receiving process (hundreds of
MiB of a GPU whose engine budgeted all of it). So a receiver maps the handle into its *own*
device's context through the driver (`cuda_driver.py`) and reads the sender's memory over peer
access (NVLink, PCIe P2P); the mapping is a tensor on the receiver's device, and every copy
runs on the receiver's streams. Only where the two GPUs cannot reach each other, or the driver
refuses, does torch's opener serve (its copies then go through the host), and for an expandable
segment's handle, which only a tensor-parallel core's own ranks share (`share_with_peers`).

CUDA cannot open an IPC handle in the process that made it (torch's own sharing keeps a cache
for that case), so a description this process shared opens as its own tensor: two engines in
one process (the tests' in-thread cores, an `LLM` beside another) pull from each other too.

Never exercised without a GPU: everything here is guarded by `torch.cuda.is_available()` and
a failure to share or open falls back to TCP (the sender offers no `shm` without a handle; a
receiver that cannot open one fails the pull, which recomputes). `pdmesh selftest` checks on a
node's first run that a pull across GPUs created no context on the sender's GPU.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdmesh.kvstore.connector import cuda_driver
from pdmesh.kvstore.connector.blocks import device_uuid
from pdmesh.kvstore.connector.cache_file import MAX_PEERS
from pdmesh.kvstore.transfer.errors import KVBackendUnavailable, KVWireError

logger = logging.getLogger(__name__)

_OWN: dict[tuple[bytes, int], weakref.ref[torch.Tensor]] = {}
"""The caches this process shared, by (handle, offset): opening one of them is a no-op."""
_OWN_LOCK = threading.Lock()

_FIELDS = ("device_uuid", "handle", "size", "offset", "ref_handle", "ref_offset", "event",
           "event_sync", "shape", "dtype")

OWN = "own"          # a cache this process shared itself
MAPPED = "mapped"    # mapped into the receiver's device context (peer access across GPUs)
TORCH = "torch"      # torch's opener, on the sender's device (a context there)


def share(cache: torch.Tensor) -> str:
    """The IPC description of a CUDA cache (JSON), or "" when it cannot be shared."""
    if cache.device.type != "cuda" or not cache.is_contiguous() or cache.storage_offset():
        return ""
    try:
        storage = cache.untyped_storage()
        (device, handle, size, offset, ref_handle, ref_offset, event,
         event_sync) = storage._share_cuda_()
        uuid = device_uuid(torch.device("cuda", device))
    except Exception as exc:  # MIG slices, drivers without IPC: TCP it is
        logger.warning("the KV cache cannot be shared over CUDA IPC (%s); peers use tcp", exc)
        return ""
    with _OWN_LOCK:
        _OWN[(bytes(handle), int(offset))] = weakref.ref(cache)
    return json.dumps({
        "device_uuid": uuid, "handle": bytes(handle).hex(), "size": int(size),
        "offset": int(offset), "ref_handle": bytes(ref_handle).hex(),
        "ref_offset": int(ref_offset), "event": bytes(event).hex() if event else "",
        "event_sync": bool(event_sync), "shape": list(cache.shape),
        "dtype": str(cache.dtype).removeprefix("torch."),
    })


def share_with_peers(cache: torch.Tensor) -> str:
    """`share` for the other engines on the node: a cudaMalloc allocation's handle, which each
    receiver maps itself. torch shares an expandable segment's memory
    (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`) as file descriptors a receiver takes
    with `pidfd_getfd`, which needs ptrace rights over the sender that sibling engines seldom
    have (yama's ptrace_scope 1 allows descendants only): every pull would fail and recompute.
    Such a cache is not offered; peers on the node pull it over tcp. (A tensor-parallel
    core's ranks are rank 0's children, and use `share`.)"""
    description = share(cache)
    if description and Description.parse(description).ipc_handle is None:
        logger.warning("the KV cache is in an expandable segment (PYTORCH_CUDA_ALLOC_CONF), "
                       "which peer engines cannot map: they pull it over tcp")
        unshare(description)
        return ""
    return description


def unshare(description: str) -> None:
    """Give back the reference torch's IPC protocol counts for a `share`, before the cache is
    freed. torch keeps a shared allocation out of its pool until every holder has released
    it, and receivers that map the handle through the driver never do: without this, an
    engine torn down in its process (tests, an `LLM` beside another) would keep its whole KV
    cache. A receiver that still maps it keeps the allocation alive on the device itself."""
    if not description:
        return
    try:
        meta = Description.parse(description)
    except KVWireError:
        return
    with _OWN_LOCK:
        _OWN.pop((meta.handle, meta.offset), None)
    if meta.ref_handle and torch.cuda.is_available():
        torch.UntypedStorage._release_ipc_counter_cuda(meta.ref_handle, meta.ref_offset)


@dataclass(frozen=True)
class Description:
    """A shared cache's description, validated."""

    device_uuid: str
    handle: bytes
    size: int      # bytes of the shared storage
    offset: int    # its start within the allocation the handle names
    ref_handle: bytes
    ref_offset: int
    event: bytes
    event_sync: bool
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def parse(cls, text: str) -> Description:
        try:
            meta: dict[str, Any] = json.loads(text)
            if not isinstance(meta, dict) or any(f not in meta for f in _FIELDS):
                raise ValueError("fields missing")
            shape = tuple(int(d) for d in meta["shape"])
            dtype = getattr(torch, str(meta["dtype"]))
            if not isinstance(dtype, torch.dtype) or len(shape) != 6 or min(shape) < 0:
                raise ValueError("bad layout")
            out = cls(str(meta["device_uuid"]), bytes.fromhex(meta["handle"]),
                      int(meta["size"]), int(meta["offset"]), bytes.fromhex(meta["ref_handle"]),
                      int(meta["ref_offset"]),
                      bytes.fromhex(meta["event"]) if meta["event"] else b"",
                      bool(meta["event_sync"]), shape, dtype)
        except (ValueError, TypeError, AttributeError) as exc:
            raise KVWireError(f"malformed CUDA IPC description: {exc}") from None
        if out.size < 0 or out.offset < 0 or out.nbytes > out.size:
            raise KVWireError("the CUDA IPC allocation is smaller than its layout")
        return out

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def ipc_handle(self) -> bytes | None:
        """The cudaIpcMemHandle the driver maps (`ipc_mem_handle`), or None."""
        return ipc_mem_handle(self.handle)


def ipc_mem_handle(handle: bytes) -> bytes | None:
    """The 64-byte cudaIpcMemHandle inside torch's shareable handle, or None for one this
    module cannot map itself (an expandable segment's; an unknown version): torch's opener.
    Since torch 2.3 a handle is [format version][b"c": a cudaMalloc block][the 64 bytes];
    versions 2 and 3 differ only elsewhere. Before, it was the 64 bytes alone."""
    size = cuda_driver.IPC_HANDLE_BYTES
    if len(handle) == size:
        return handle
    if len(handle) == size + 2 and handle[0] in (1, 2, 3) and handle[1:2] == b"c":
        return handle[2:]
    return None


def mappable(description: str) -> bool:
    """Whether this process maps the description's handle itself, through the driver (else
    torch's opener serves it: an expandable segment's handle, no driver)."""
    try:
        handle = Description.parse(description).ipc_handle
    except KVWireError:
        return False
    return handle is not None and cuda_driver.driver() is not None


@dataclass(frozen=True)
class PeerMapping:
    """A peer's cache as this process reaches it, how it was opened (`OWN`, `MAPPED`,
    `TORCH`), and what unmaps it (only a `MAPPED` one needs it: torch unmaps its own when the
    storage dies, and nothing may use `tensor` after `close`)."""

    tensor: torch.Tensor
    how: str
    close: Callable[[], None] = lambda: None


def _local_device(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", index)) == uuid:
            return index
    raise KVBackendUnavailable(f"the peer's GPU {uuid} is not visible to this process")


def open_peer(description: str, into: torch.device | None = None) -> PeerMapping:
    """Map a peer's shared cache into this process (read only by convention), in the context
    of `into` (the receiving cache's device) wherever the GPUs allow it."""
    if not torch.cuda.is_available():
        raise KVBackendUnavailable("a CUDA IPC source needs CUDA in this process")
    meta = Description.parse(description)
    own = _own(meta.handle, meta.offset)
    if own is not None:  # shared by this process: CUDA would refuse to open it here
        if tuple(own.shape) != meta.shape or own.dtype != meta.dtype:
            raise KVWireError("the CUDA IPC description does not match the cache it names")
        return PeerMapping(own, OWN)
    device = _local_device(meta.device_uuid)
    torch.cuda._lazy_init()
    if into is not None and into.type == "cuda":
        index = into.index if into.index is not None else torch.cuda.current_device()
        mapped = _map_into(meta, device, index)
        if mapped is not None:
            return mapped
    return PeerMapping(_open_with_torch(meta, device), TORCH)


@dataclass
class _Mapped:
    base: int   # the allocation's address in this process
    users: int  # PeerMappings over it not yet closed


_MAPPED: dict[tuple[bytes, int], _Mapped] = {}
"""The driver mappings of this process, by (cudaIpcMemHandle, device): CUDA maps a handle once
per context, and two engines of one process (a tensor-parallel core's rank 0 and a peer
pulling from the same ranks) may both need it, as torch's own opener allows."""
_MAPPED_LOCK = threading.Lock()


def _map_into(meta: Description, src: int, dst: int) -> PeerMapping | None:
    """The allocation mapped into device `dst`'s context (None: torch's opener instead)."""
    driver = cuda_driver.driver()
    handle = meta.ipc_handle
    if driver is None or handle is None:
        return None
    if src != dst and not torch.cuda.can_device_access_peer(dst, src):
        return None  # no P2P between the two: only torch's opener reaches it (via the host)
    try:
        base = _acquire(driver, handle, dst)
    except cuda_driver.CudaDriverError as exc:
        logger.warning("the peer's KV cache cannot be mapped on cuda:%d (%s); opening it on "
                       "cuda:%d instead", dst, exc, src)
        return None
    close = functools.partial(_unmap, driver, (handle, dst))
    try:
        device = torch.device("cuda", dst)
        storage = torch._C._construct_storage_from_data_pointer(base + meta.offset, device,
                                                                 meta.size)
        tensor = torch.empty(0, dtype=meta.dtype, device=device).set_(storage, 0, meta.shape)
    except Exception as exc:  # a torch without storages over foreign memory: its own opener
        close()
        logger.warning("the peer's KV cache cannot be wrapped on cuda:%d (%s); opening it on "
                       "cuda:%d instead", dst, exc, src)
        return None
    return PeerMapping(tensor, MAPPED, close)


def _acquire(driver: cuda_driver.Driver, handle: bytes, device: int) -> int:
    """The handle's allocation mapped on `device` (mapped now, or already): its address."""
    with _MAPPED_LOCK:
        mapped = _MAPPED.get((handle, device))
        if mapped is None:
            mapped = _MAPPED[(handle, device)] = _Mapped(driver.open_ipc(handle, device), 0)
        mapped.users += 1
        return mapped.base


def _unmap(driver: cuda_driver.Driver, key: tuple[bytes, int]) -> None:
    """One PeerMapping over a driver mapping closed: unmapped with the last of them."""
    with _MAPPED_LOCK:  # closed under the lock: a new open of the handle waits for it
        mapped = _MAPPED[key]
        mapped.users -= 1
        if mapped.users == 0:
            del _MAPPED[key]
            driver.close_ipc(mapped.base, key[1])


def _open_with_torch(meta: Description, device: int) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared_cuda(
        device, meta.handle, meta.size, meta.offset, meta.ref_handle, meta.ref_offset,
        meta.event, meta.event_sync)
    tensor = torch.empty(0, dtype=meta.dtype, device=f"cuda:{device}")
    tensor.set_(storage, 0, meta.shape)
    return tensor


def _own(handle: bytes, offset: int) -> torch.Tensor | None:
    with _OWN_LOCK:
        ref = _OWN.get((handle, offset))
        tensor = ref() if ref is not None else None
        if ref is not None and tensor is None:  # freed: its allocation may be another's now
            del _OWN[(handle, offset)]
        return tensor


@dataclass
class _Entry:
    mapping: PeerMapping
    users: int = 0  # pulls between `opened` and its end


class PeerDeviceCaches:
    """Peer caches opened on first use and kept, up to `MAX_PEERS`, most recent first (each
    mapping keeps its peer's whole allocation alive on that GPU, even after the peer exited,
    so a restarted peer's old mapping goes once newer ones push it out). Opened under the lock:
    two pulls from a new peer share one mapping (CUDA maps a handle once per context). A
    mapping pushed out while a pull copies from it is closed when that pull ends."""

    def __init__(self) -> None:
        self._maps: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._retired: dict[tuple[str, str], _Entry] = {}  # pushed out, still in use
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def opened(self, descriptions: Sequence[str],
               into: torch.device) -> Iterator[list[torch.Tensor]]:
        """The peers' caches, for the block only: at its end nothing queued on `into` still
        reads them (the pull's own copies were waited for; a failed one's are waited here)."""
        taken: list[_Entry] = []
        try:
            with self._lock:
                for description in descriptions:
                    taken.append(self._take(description, into))
            yield [entry.mapping.tensor for entry in taken]
        finally:
            if taken and into.type == "cuda":
                torch.cuda.current_stream(into).synchronize()
            with self._lock:
                for entry in taken:
                    entry.users -= 1
                self._close_unused()

    def _take(self, description: str, into: torch.device) -> _Entry:
        key = (description, str(into))
        entry = self._maps.get(key) or self._retired.pop(key, None)
        if entry is None:
            entry = _Entry(open_peer(description, into))
        self._maps[key] = entry
        self._maps.move_to_end(key)
        entry.users += 1
        while len(self._maps) > MAX_PEERS:
            old_key, old = self._maps.popitem(last=False)
            self._retired[old_key] = old
        self._close_unused()
        return entry

    def _close_unused(self) -> None:
        for key in [k for k, e in self._retired.items() if e.users == 0]:
            try:
                self._retired.pop(key).mapping.close()
            except cuda_driver.CudaDriverError as exc:
                logger.warning("closing a peer's KV cache mapping: %s", exc)

    def clear(self) -> None:
        with self._lock:
            self._retired.update(self._maps)
            self._maps.clear()
            self._close_unused()
