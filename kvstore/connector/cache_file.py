"""A CPU KV cache that a peer engine core on the same host can read: one shared-memory file.

The cache is allocated as a file in the shm directory (mode 0600, created exclusively, named
like every KV segment `pdmesh-kv-<pidns>-<pid>-<hex>`, the pid being the serving process's,
so the sweeps after a dead service (`pdmesh serve`, the next start) remove it; a core that dies
alone has its file removed by its serving process) and mapped shared. tmpfs pages are zero-filled
and committed on first write, so an idle cache costs no memory, as the anonymous mapping of
`engine/core/memory.py` did. The file is unlinked when the core closes it.

A peer maps it read-only (`PeerCaches`) after checking it is a regular file of ours, private,
of exactly the size the layout implies, and copies the blocks it needs straight into its own
cache: the only copy on the host. Which process may name the file is the control plane's
business (the receiver proved it shares the shm directory; the sender granted the pull).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import re
import stat
import threading
import uuid
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch

from pdmesh.kvstore.transfer.errors import KVSenderUnavailable, KVWireError
from pdmesh.leftovers import pid_namespace

NAME = re.compile(r"pdmesh-kv-(\d+)-(\d+)-([0-9a-f]{32})")
MAX_PEERS = 16  # peer caches kept mapped; the least recently used is unmapped past this


@dataclass
class SharedCache:
    """The cache tensor and the file behind it."""

    tensor: torch.Tensor
    path: str

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def close(self) -> None:
        """Unlink the file; the mapping lives on until the tensor is freed."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def cache_file_name(owner_pid: int = 0) -> str:
    """A new cache file's name, after `owner_pid` (default: this process): the process whose
    death makes it garbage. A tensor-parallel core names its ranks' files before they start."""
    return f"pdmesh-kv-{pid_namespace()}-{owner_pid or os.getpid()}-{uuid.uuid4().hex}"


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype, shm_dir: str,
                 owner_pid: int = 0, name: str = "") -> SharedCache:
    """A zero tensor of `shape` backed by a new 0600 file in `shm_dir`, named `name` (a
    `cache_file_name`; default: a new one after `owner_pid`)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    name = name or cache_file_name(owner_pid)
    if not NAME.fullmatch(name):
        raise ValueError(f"not a KV cache file name: {name!r}")
    path = os.path.join(os.path.realpath(shm_dir), name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        buffer = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    os.close(fd)
    # frombuffer keeps `buffer` alive for as long as the tensor (or a view of it) lives.
    tensor = torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape)).view(shape)
    return SharedCache(tensor, path)


def room_for(shm_dir: str, nbytes: int) -> int:
    """Bytes the shm filesystem can still give a new cache of `nbytes`: its free space less
    what the KV files already there may still claim (they are sparse and grow as blocks are
    written). A tmpfs that runs out under a mapped file kills the writer with SIGBUS, so a
    cache that does not fit is not put there (`engine/core/startup.py` falls back to private
    memory; peers then pull over tcp)."""
    try:
        st = os.statvfs(os.path.realpath(shm_dir))
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize - owed_by_caches(shm_dir)


def owed_by_caches(shm_dir: str) -> int:
    """Bytes the KV files in `shm_dir` may still claim: their size less what they hold."""
    directory = os.path.realpath(shm_dir)
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    owed = 0
    for name in names:
        if NAME.fullmatch(name):
            with contextlib.suppress(OSError):
                info = os.stat(os.path.join(directory, name))
                owed += max(0, info.st_size - info.st_blocks * 512)
    return owed


def open_peer(shm_dir: str, name: str, shape: tuple[int, ...], dtype: torch.dtype,
              writable: bool = False) -> torch.Tensor:
    """Map a peer core's cache file read-only, after checking what it claims to be.
    `writable`: a tensor-parallel core's own other ranks' caches, which it loads pulled
    blocks into (never a peer engine's)."""
    if not NAME.fullmatch(name):
        raise KVWireError(f"not a KV cache file name: {name!r}")
    path = os.path.join(os.path.realpath(shm_dir), name)
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW)
    except OSError as exc:
        raise KVSenderUnavailable(f"peer KV cache {name} is gone: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise KVWireError(f"peer KV cache {name} is not a regular file of this user")
        if st.st_mode & 0o077:
            raise KVWireError(f"peer KV cache {name} is readable by others")
        if st.st_size != max(nbytes, 1):
            raise KVWireError(f"peer KV cache {name} has {st.st_size} bytes, its layout "
                              f"{tuple(shape)} {dtype} needs {nbytes}")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        buffer = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=prot)
    finally:
        os.close(fd)
    if writable:
        return torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape)).view(shape)
    with warnings.catch_warnings():  # read-only on purpose: we never write a peer's cache
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape))
    return tensor.view(shape)


class PeerCaches:
    """Peer caches mapped on first use and kept, up to `MAX_PEERS`, most recent first.

    A mapping outlives its file's unlink (the peer exited), so a name is re-checked on the
    filesystem at each use and its mapping dropped once the file is gone.
    """

    def __init__(self, shm_dir: str) -> None:
        self._dir = shm_dir
        self._maps: OrderedDict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = \
            OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (name, tuple(shape), dtype)
        with self._lock:
            if not os.path.exists(os.path.join(os.path.realpath(self._dir), name)):
                self._maps.pop(key, None)
                raise KVSenderUnavailable(f"peer KV cache {name} is gone")
            tensor = self._maps.get(key)
            if tensor is not None:
                self._maps.move_to_end(key)
                return tensor
        tensor = open_peer(self._dir, name, shape, dtype)
        with self._lock:
            self._maps[key] = tensor
            while len(self._maps) > MAX_PEERS:
                self._maps.popitem(last=False)
        return tensor

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()

