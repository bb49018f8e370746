"""The KV offload tiers behind the paged cache: host memory, then optionally local disk.

The block pool (engine/scheduling/block_pool.py) saves a cached block here when it evicts it
and restores one when a prompt's prefix walk misses the paged cache but a tier holds the hash
(`KVTier`, engine/scheduling/kv_tier.py). Both tiers are LRU and bounded in bytes
(`--kv-offload-host-bytes`, `--kv-offload-disk-bytes`); they are *inclusive*: a restored block
keeps its tier copy, so evicting it again costs no copy. When the host tier is full its LRU
block spills to the disk tier (one file per block, engine/core/kv_block_file.py) and is
dropped from host memory.

Every block carries a checksum (kvstore/connector/blocks.py, over the block's bytes in
(layer, K/V) order) taken when it enters the host tier and checked on every restore, from
memory or from disk: a mismatch is a miss (counted in `restore_failures`), the copy is
dropped, and the prompt computes those tokens instead.

On CUDA the host tier is pinned memory and copies run on a side stream: a save's
device-to-host copy waits for the work already queued on the engine's stream (which may be
computing the block), and the engine's stream waits for the copy before its next kernel can
overwrite the block; a restore is the same in the other direction. The host thread only waits
when it must read a block's bytes itself (its checksum, a spill to disk).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pdmesh.engine.block_hash import BlockHash
from pdmesh.engine.core.kv_block_file import (
    BlockFileError,
    BlockFileHeader,
    BlockLayout,
    read_block_file,
    write_block_file,
)
from pdmesh.engine.core.memory import lazy_zeros
from pdmesh.engine.kv_events import (
    MEDIUM_DISK,
    MEDIUM_HOST,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Medium,
)
from pdmesh.engine.scheduling.kv_tier import TierFigures
from pdmesh.kvstore.connector.blocks import block_checksums, block_nbytes, default_block_algo

logger = logging.getLogger(__name__)

BLOCK_FILE_SUFFIX = ".kvb"


@dataclass
class _HostEntry:
    slot: int
    checksum: int | None  # None until the copy into the slot has landed (CUDA)
    copied: torch.cuda.Event | None = None


def _emit(events: list[KVEvent], event: KVEvent) -> None:
    """Append, merging into the previous event when it is the same kind on the same medium."""
    if events:
        last = events[-1]
        if (isinstance(event, BlockStored) and isinstance(last, BlockStored)
                and last.medium == event.medium and event.parent_hash is None):
            events[-1] = BlockStored(last.block_hashes + event.block_hashes, last.parent_hash,
                                     last.medium)
            return
        if (isinstance(event, BlockRemoved) and isinstance(last, BlockRemoved)
                and last.medium == event.medium):
            events[-1] = BlockRemoved(last.block_hashes + event.block_hashes, last.medium)
            return
    events.append(event)


class DiskTier:
    """Block files under a directory of this process's own, LRU, at most `capacity` files."""

    def __init__(self, root: Path, capacity: int, layout: BlockLayout) -> None:
        root.mkdir(parents=True, exist_ok=True)
        # A directory of our own: nothing else under `root` is ever read or removed.
        self.dir = Path(tempfile.mkdtemp(prefix="pdmesh-kvtier-", dir=root))
        self.capacity = capacity
        self.layout = layout
        self.files: OrderedDict[BlockHash, None] = OrderedDict()

    def path(self, block_hash: BlockHash) -> Path:
        return self.dir / (block_hash.hex() + BLOCK_FILE_SUFFIX)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.files

    def put(self, header: BlockFileHeader, payload: memoryview) -> list[BlockHash]:
        """Write one block; the hashes evicted to make room (their files deleted)."""
        evicted = []
        while len(self.files) >= self.capacity:
            old, _ = self.files.popitem(last=False)
            self.path(old).unlink(missing_ok=True)
            evicted.append(old)
        write_block_file(self.path(header.block_hash), self.layout, header, payload)
        self.files[header.block_hash] = None
        return evicted

    def read(self, block_hash: BlockHash, into: memoryview) -> BlockFileHeader:
        header = read_block_file(self.path(block_hash), self.layout, block_hash, into)
        self.files.move_to_end(block_hash)
        return header

    def touch(self, block_hash: BlockHash) -> None:
        self.files.move_to_end(block_hash)

    def remove(self, block_hash: BlockHash) -> None:
        self.files.pop(block_hash, None)
        self.path(block_hash).unlink(missing_ok=True)

    def clear(self) -> None:
        for block_hash in list(self.files):
            self.remove(block_hash)

    def close(self) -> None:
        self.files.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


class KVOffload:
    """The host tier (and the disk tier behind it) of one paged cache: a `KVTier`."""

    def __init__(self, cache: torch.Tensor, host_bytes: int, disk_dir: str | None = None,
                 disk_bytes: int = 0) -> None:
        self.cache = cache
        self.block_bytes = block_nbytes(cache)
        capacity = host_bytes // self.block_bytes
        if capacity < 1:
            raise ValueError(f"kv_offload_host_bytes: {host_bytes} bytes hold no KV block "
                             f"({self.block_bytes} bytes each)")
        layers, _, _, block_size, heads, head_dim = cache.shape
        # Slot-major: each block's bytes are contiguous (one async copy each way on CUDA, a
        # file write without a gather, a checksum over one small tensor).
        shape = (capacity, layers, 2, block_size, heads, head_dim)
        self.on_cuda = cache.device.type == "cuda"
        if self.on_cuda:
            self.host = torch.empty(shape, dtype=cache.dtype, pin_memory=True)
            self.staging = torch.empty((layers, 2, 1, block_size, heads, head_dim),
                                       dtype=cache.dtype, pin_memory=True)
            self.side = torch.cuda.Stream(device=cache.device)
            self._staging_free: torch.cuda.Event | None = None
        else:
            self.host = lazy_zeros(shape, cache.dtype, torch.device("cpu"))  # committed on use
            self.staging = torch.empty((layers, 2, 1, block_size, heads, head_dim),
                                       dtype=cache.dtype)
        self.algo = default_block_algo(self.staging)
        self.entries: OrderedDict[BlockHash, _HostEntry] = OrderedDict()
        self.free_slots = list(range(capacity - 1, -1, -1))
        self.capacity = capacity
        self.disk: DiskTier | None = None
        if disk_dir is not None:
            layout = BlockLayout(str(cache.dtype).removeprefix("torch."), layers, block_size,
                                 heads, head_dim, cache.element_size())
            file_bytes = self.block_bytes + 128  # the header, rounded up
            if disk_bytes // file_bytes < 1:
                raise ValueError(f"kv_offload_disk_bytes: {disk_bytes} bytes hold no KV block "
                                 f"file ({file_bytes} bytes each)")
            self.disk = DiskTier(Path(disk_dir), disk_bytes // file_bytes, layout)
        self._events: list[KVEvent] = []
        self._stats = {"host_saved": 0, "disk_saved": 0, "host_restored": 0,
                       "disk_restored": 0, "failures": 0}

    # -- KVTier ----------------------------------------------------------------------------
    def save(self, block_id: int, block_hash: BlockHash) -> None:
        entry = self.entries.get(block_hash)
        if entry is not None:
            self.entries.move_to_end(block_hash)
            return
        slot = self._free_slot()
        entry = _HostEntry(slot, None)
        if self.on_cuda:
            main = torch.cuda.current_stream(self.cache.device)
            self.side.wait_stream(main)  # the block may still be being computed
            with torch.cuda.stream(self.side):
                self.host[slot].copy_(self.cache[:, :, block_id], non_blocking=True)
                entry.copied = torch.cuda.Event(blocking=True)
                entry.copied.record(self.side)
            main.wait_event(entry.copied)  # its next owner writes only after the copy
        else:
            self.host[slot].copy_(self.cache[:, :, block_id])
            entry.checksum = self._checksum(slot)
        self.entries[block_hash] = entry
        self._stats["host_saved"] += 1
        _emit(self._events, BlockStored((block_hash,), None, MEDIUM_HOST))

    def holds(self, block_hash: BlockHash) -> Medium | None:
        if block_hash in self.entries:
            return MEDIUM_HOST
        if self.disk is not None and block_hash in self.disk:
            return MEDIUM_DISK
        return None

    def prefer(self, block_hashes: Sequence[BlockHash]) -> None:
        for block_hash in reversed(block_hashes):  # the first of the prompt ends up newest
            if block_hash in self.entries:
                self.entries.move_to_end(block_hash)
            elif self.disk is not None and block_hash in self.disk:
                self.disk.touch(block_hash)

    def restore(self, block_hash: BlockHash, block_id: int) -> bool:
        entry = self.entries.get(block_hash)
        if entry is not None:
            self._settle(entry)
            if self._checksum(entry.slot) != entry.checksum:
                logger.warning("KV offload: host block %s failed its checksum; recomputed",
                               block_hash.hex()[:16])
                self.free_slots.append(self._drop_host(block_hash))
                self._stats["failures"] += 1
                return False
            self._copy_in(self.host[entry.slot], block_id)
            self.entries.move_to_end(block_hash)
            self._stats["host_restored"] += 1
            return True
        if self.disk is None or block_hash not in self.disk:
            return False
        if self.on_cuda and self._staging_free is not None:
            self._staging_free.synchronize()  # the last disk restore's copy has read it
        try:
            header = self.disk.read(block_hash, _bytes_of(self.staging))
            if block_checksums(header.algo, self.staging, [0])[0] != header.checksum:
                raise BlockFileError("checksum mismatch")
        except BlockFileError as exc:
            logger.warning("KV offload: disk block %s unusable (%s); recomputed",
                           block_hash.hex()[:16], exc)
            self.disk.remove(block_hash)
            _emit(self._events, BlockRemoved((block_hash,), MEDIUM_DISK))
            self._stats["failures"] += 1
            return False
        self._copy_in(self.staging[:, :, 0], block_id)
        self._stats["disk_restored"] += 1
        return True

    def clear(self) -> None:
        for entry in self.entries.values():
            self._settle(entry)
            self.free_slots.append(entry.slot)
        self.entries.clear()
        if self.disk is not None:
            self.disk.clear()
        self._events.clear()

    def held_hashes(self) -> dict[Medium, list[BlockHash]]:
        held: dict[Medium, list[BlockHash]] = {MEDIUM_HOST: list(self.entries)}
        if self.disk is not None:
            held[MEDIUM_DISK] = list(self.disk.files)
        return held

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def figures(self) -> TierFigures:
        s = self._stats
        return TierFigures(
            host_blocks=len(self.entries), host_capacity_blocks=self.capacity,
            disk_blocks=len(self.disk.files) if self.disk is not None else 0,
            disk_capacity_blocks=self.disk.capacity if self.disk is not None else 0,
            host_saved_blocks=s["host_saved"], disk_saved_blocks=s["disk_saved"],
            host_restored_blocks=s["host_restored"], disk_restored_blocks=s["disk_restored"],
            restore_failures=s["failures"], block_bytes=self.block_bytes)

    def close(self) -> None:
        """Remove the disk tier's directory (the blocks are this process's only)."""
        if self.disk is not None:
            self.disk.close()

    # -- inside ----------------------------------------------------------------------------
    def _free_slot(self) -> int:
        """A host slot, spilling the least recently used block to disk when none is free."""
        if self.free_slots:
            return self.free_slots.pop()
        old_hash, old = next(iter(self.entries.items()))
        if self.disk is not None and old_hash not in self.disk:
            self._settle(old)
            payload = self.host[old.slot]
            assert old.checksum is not None
            header = BlockFileHeader(self.algo, old.checksum, old_hash)
            try:
                for gone in self.disk.put(header, _bytes_of(payload)):
                    _emit(self._events, BlockRemoved((gone,), MEDIUM_DISK))
            except OSError as exc:  # a full or failing disk loses the block, not the step
                logger.warning("KV offload: spilling a block to %s failed: %s", self.disk.dir,
                               exc)
            else:
                self._stats["disk_saved"] += 1
                _emit(self._events, BlockStored((old_hash,), None, MEDIUM_DISK))
        return self._drop_host(old_hash)

    def _drop_host(self, block_hash: BlockHash) -> int:
        """Forget a host block; its slot, for the caller to reuse or free. (A copy still in
        flight into the slot is ordered before any later one on the side stream.)"""
        entry = self.entries.pop(block_hash)
        _emit(self._events, BlockRemoved((block_hash,), MEDIUM_HOST))
        return entry.slot

    def _settle(self, entry: _HostEntry) -> None:
        """Wait for the entry's copy to land, then take its checksum (CUDA saves)."""
        if entry.copied is not None:
            entry.copied.synchronize()
            entry.copied = None
            entry.checksum = self._checksum(entry.slot)

    def _checksum(self, slot: int) -> int:
        """The slot's block checksum, as the connector takes it for a block of a cache."""
        return block_checksums(self.algo, self.host[slot].unsqueeze(2), [0])[0]

    def _copy_in(self, source: torch.Tensor, block_id: int) -> None:
        """Paged block `block_id` = `source` (one block, `[layers, 2, block_size, ...]`)."""
        if not self.on_cuda:
            self.cache[:, :, block_id].copy_(source)
            return
        main = torch.cuda.current_stream(self.cache.device)
        self.side.wait_stream(main)  # the block's previous owner is done with it
        with torch.cuda.stream(self.side):
            self.cache[:, :, block_id].copy_(source, non_blocking=True)
            done = torch.cuda.Event(blocking=True)
            done.record(self.side)
        main.wait_event(done)
        self._staging_free = done  # (a restore from the host tier orders after it too)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, writable, without a copy."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")
