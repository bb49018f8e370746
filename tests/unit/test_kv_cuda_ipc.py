"""Same host, GPU: a peer's cache opened over CUDA IPC (kvstore/connector/cuda_ipc.py) and the
driver calls that map it into the receiver's own context (cuda_driver.py).

Without a GPU: the handle's format, the description's checks, the mappings' lifetimes (with a
faked opener) and the driver binding's call discipline (with a faked libcuda, and against a
stand-in compiled from the driver's C prototypes). Where CUDA is, a spawned process maps a
cache shared here, on the same GPU and across two."""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pdmesh.kvstore.connector import cuda_driver, cuda_ipc
from pdmesh.kvstore.connector.blocks import block_checksums
from pdmesh.kvstore.connector.cuda_ipc import Description, PeerMapping, ipc_mem_handle
from pdmesh.kvstore.connector.source import KVSource, encode_blocks
from pdmesh.kvstore.transfer.checksum import ChecksumAlgo
from pdmesh.kvstore.transfer.errors import KVBackendUnavailable, KVWireError

SHAPE = (3, 2, 24, 4, 2, 8)  # layers, K/V, blocks, block_size, kv_heads, head_dim
CPU = torch.device("cpu")


@pytest.mark.fast
def test_the_ipc_handle_is_read_out_of_every_cudamalloc_format_torch_writes() -> None:
    raw = bytes(range(64))
    assert ipc_mem_handle(raw) == raw  # before torch 2.3: the handle alone
    for version in (1, 2, 3):
        assert ipc_mem_handle(bytes([version]) + b"c" + raw) == raw
    assert ipc_mem_handle(b"\x03e" + raw) is None  # an expandable segment: torch's opener
    assert ipc_mem_handle(b"\x09c" + raw) is None  # a version this code does not know
    assert ipc_mem_handle(b"\x03c" + raw[:63]) is None


def _description(**change: Any) -> str:
    meta = {"device_uuid": "GPU-x", "handle": "0c" * 66, "size": 4 * 2 * 2 * 3 * 4 * 5 * 42,
            "offset": 512, "ref_handle": "", "ref_offset": 0, "event": "", "event_sync": False,
            "shape": [2, 2, 3, 4, 5, 6 * 7], "dtype": "float32"}
    return json.dumps({**meta, **change})


@pytest.mark.fast
def test_a_description_is_checked_before_anything_is_opened() -> None:
    meta = Description.parse(_description())
    assert (meta.shape, meta.dtype, meta.offset) == ((2, 2, 3, 4, 5, 42), torch.float32, 512)
    assert meta.nbytes == meta.size
    for bad in ("{", "[]", _description(shape=[1, 2]), _description(dtype="nonsense"),
                _description(dtype="Tensor"), _description(handle="zz"),
                _description(size=100),  # smaller than its layout
                _description(offset=-1), json.dumps({"handle": "00"})):
        with pytest.raises(KVWireError):
            Description.parse(bad)


@pytest.mark.fast
def test_unsharing_forgets_the_cache_as_this_processs_own() -> None:
    import weakref

    cache = torch.zeros(1)
    meta = Description.parse(_description())
    key = (meta.handle, meta.offset)
    cuda_ipc._OWN[key] = weakref.ref(cache)
    cuda_ipc.unshare(_description(ref_handle=""))  # no counter named: nothing to release
    assert key not in cuda_ipc._OWN
    cuda_ipc.unshare("")  # a cache that was never shared
    cuda_ipc.unshare("{")  # nor a malformed one: teardown never raises on it


@pytest.mark.fast
def test_a_plain_handle_is_mapped_here_only_where_a_driver_is(monkeypatch) -> None:
    plain, segment = "03" + "63" + "ab" * 64, "03" + "65" + "ab" * 64  # b"c", b"e"
    monkeypatch.setattr(cuda_driver, "driver", lambda: object())
    assert cuda_ipc.mappable(_description(handle=plain))
    assert not cuda_ipc.mappable(_description(handle=segment))  # torch's opener serves it
    assert not cuda_ipc.mappable("{")
    monkeypatch.setattr(cuda_driver, "driver", lambda: None)
    assert not cuda_ipc.mappable(_description(handle=plain))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal where no GPU is")
@pytest.mark.fast
def test_a_host_without_cuda_refuses_an_ipc_source() -> None:
    with pytest.raises(KVBackendUnavailable):
        cuda_ipc.open_peer(_description(), CPU)


class _Opened:
    """A faked `open_peer` that records every open and close (no GPU here)."""

    def __init__(self) -> None:
        self.opened: list[str] = []
        self.closed: list[str] = []

    def __call__(self, description: str, into: torch.device | None = None) -> PeerMapping:
        self.opened.append(description)
        time.sleep(0.01)  # a slow open: a second caller would open it again if unlocked
        return PeerMapping(torch.zeros(1), cuda_ipc.MAPPED,
                           lambda: self.closed.append(description))


@pytest.fixture
def opener(monkeypatch) -> _Opened:
    fake = _Opened()
    monkeypatch.setattr(cuda_ipc, "open_peer", fake)
    return fake


def _use(peers: cuda_ipc.PeerDeviceCaches, *descriptions: str) -> list[torch.Tensor]:
    with peers.opened(descriptions, CPU) as tensors:
        return tensors


@pytest.mark.fast
def test_peer_device_caches_are_kept_most_recent_first_and_opened_once(opener) -> None:
    """At most MAX_PEERS mappings, the least recently used closed first; concurrent first uses
    of one peer share a single open (CUDA maps a handle once per context)."""
    peers = cuda_ipc.PeerDeviceCaches()
    first = _use(peers, "p0") + _use(peers, "p0")
    assert first[0] is first[1] and opener.opened == ["p0"]
    for i in range(1, cuda_ipc.MAX_PEERS):
        _use(peers, f"p{i}")
    _use(peers, "p0")  # used again: the most recent now
    _use(peers, "new")  # one too many: p1, the least recently used, goes
    assert opener.closed == ["p1"]
    assert _use(peers, "p0")[0] is first[0] and opener.opened.count("p0") == 1
    _use(peers, "p1")
    assert opener.opened.count("p1") == 2

    threads = [threading.Thread(target=_use, args=(peers, "shared")) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert opener.opened.count("shared") == 1
    peers.clear()
    assert sorted(opener.closed) == sorted(opener.opened)  # each open closed exactly once


@pytest.mark.fast
def test_a_mapping_pushed_out_mid_pull_is_closed_when_the_pull_ends(opener) -> None:
    peers = cuda_ipc.PeerDeviceCaches()
    with peers.opened(["busy"], CPU) as (busy,):
        for i in range(cuda_ipc.MAX_PEERS):  # pushes "busy" out while it is copied from
            _use(peers, f"p{i}")
        assert "busy" not in opener.closed
        # Wanted again meanwhile: the same mapping comes back (a second open would fail).
        assert _use(peers, "busy")[0] is busy and opener.opened.count("busy") == 1
        for i in range(cuda_ipc.MAX_PEERS):
            _use(peers, f"q{i}")
        assert "busy" not in opener.closed
    assert opener.closed.count("busy") == 1


@pytest.mark.fast
def test_a_failed_pull_gives_its_mappings_back(opener) -> None:
    peers = cuda_ipc.PeerDeviceCaches()
    with pytest.raises(KVWireError), peers.opened(["a", "b"], CPU):
        raise KVWireError("the peer's device cache has another layout")
    for i in range(cuda_ipc.MAX_PEERS):
        _use(peers, f"p{i}")
    assert sorted(opener.closed) == ["a", "b"]  # unused, so closed when pushed out


class _FakeLibcuda:
    """libcuda's entry points as plain callables: a call log, and failures on demand."""

    def __init__(self, fail: str = "") -> None:
        self.log: list[str] = []
        self.handles: list[bytes] = []
        self.fail = fail
        for symbol in ("cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                       "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxGetState",
                       "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2", "cuIpcOpenMemHandle",
                       "cuIpcCloseMemHandle"):
            setattr(self, symbol, self._entry(symbol))
        self.cuGetErrorName = self._error_name

    def _entry(self, symbol: str) -> Callable[..., int]:
        def call(*args: Any) -> int:
            self.log.append(symbol)
            if symbol == "cuIpcOpenMemHandle":
                args[0]._obj.value = 0x7000_0000  # the byref'd address
                self.handles.append(bytes(args[1]))  # the struct, by value
            return 201 if symbol == self.fail else 0  # CUDA_ERROR_INVALID_CONTEXT

        return call

    @staticmethod
    def _error_name(code: int, out: Any) -> int:
        out._obj.value = b"CUDA_ERROR_INVALID_CONTEXT"
        return 0


@pytest.mark.fast
def test_the_driver_maps_a_handle_with_the_receivers_context_current() -> None:
    lib = _FakeLibcuda()
    driver = cuda_driver.Driver(cuda_driver._resolve(lib))  # type: ignore[arg-type]
    handle = bytes(range(1, 65))
    assert driver.open_ipc(handle, 1) == 0x7000_0000
    assert lib.handles == [handle]
    assert lib.log == ["cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent_v2",
                       "cuIpcOpenMemHandle", "cuCtxPopCurrent_v2",
                       "cuDevicePrimaryCtxRelease_v2"]  # the unversioned open where no _v2
    with pytest.raises(ValueError):
        driver.open_ipc(bytes(66), 1)  # torch's whole handle, not the cudaIpcMemHandle


@pytest.mark.fast
def test_a_failed_driver_call_leaves_no_context_pushed_or_retained() -> None:
    lib = _FakeLibcuda(fail="cuIpcOpenMemHandle")
    driver = cuda_driver.Driver(cuda_driver._resolve(lib))  # type: ignore[arg-type]
    with pytest.raises(cuda_driver.CudaDriverError, match="CUDA_ERROR_INVALID_CONTEXT"):
        driver.open_ipc(bytes(64), 0)
    assert lib.log[-2:] == ["cuCtxPopCurrent_v2", "cuDevicePrimaryCtxRelease_v2"]
    lib = _FakeLibcuda(fail="cuCtxPushCurrent_v2")
    driver = cuda_driver.Driver(cuda_driver._resolve(lib))  # type: ignore[arg-type]
    with pytest.raises(cuda_driver.CudaDriverError):
        driver.close_ipc(0x7000_0000, 0)
    assert lib.log[-1] == "cuDevicePrimaryCtxRelease_v2"
    assert "cuCtxPopCurrent_v2" not in lib.log and "cuIpcCloseMemHandle" not in lib.log
    with pytest.raises(AttributeError):
        cuda_driver._resolve(ctypes)  # type: ignore[arg-type]  # no libcuda symbols at all


# -- where CUDA is ----------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_unshared_cache_goes_back_to_torchs_pool_when_freed() -> None:
    """torch holds a shared allocation until its IPC count is released, and a receiver that
    maps it through the driver never releases it: the sender's `unshare` does, so a cache
    freed in its process is memory again (not kept in torch's limbo)."""
    import gc

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    cache = torch.empty((*SHAPE[:2], 4096, *SHAPE[3:]), device="cuda:0")
    description = cuda_ipc.share(cache)
    assert description and torch.cuda.memory_allocated() > before
    cuda_ipc.unshare(description)
    del cache
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cache_in_an_expandable_segment_is_not_offered_to_peers() -> None:
    """Its handle would need ptrace rights over the sender to import: peers pull over tcp."""
    plain = torch.empty(SHAPE, device="cuda:0")
    description = cuda_ipc.share_with_peers(plain)
    assert description and Description.parse(description).ipc_handle is not None
    cuda_ipc.unshare(description)
    torch.cuda.empty_cache()
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    try:  # 64 MiB, a size no cached block of the tests before has
        segment = torch.empty((16, 2, 64, 16, 2, 256), device="cuda:0")
        probe = cuda_ipc.share(segment)
        expandable = not probe or Description.parse(probe).ipc_handle is None
        cuda_ipc.unshare(probe)
        if not expandable:
            pytest.skip("this torch did not put the tensor in an expandable segment")
        assert cuda_ipc.share_with_peers(segment) == ""
        del segment
    finally:
        torch.cuda.empty_cache()
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")


def _map_in_child(description: str, blocks: str, into: str, out) -> None:  # spawned
    from pdmesh.kvstore.connector.rank_caches import RankCaches
    from pdmesh.kvstore.connector.selfcheck import devices_with_context
    from pdmesh.kvstore.connector.shm_peer import ShmPeerTransport

    device = torch.device(into)
    torch.cuda.set_device(device)
    dst = torch.zeros(SHAPE, device=device)
    before = devices_with_context()
    mapping = cuda_ipc.open_peer(description, device)
    peek = block_checksums(ChecksumAlgo.XXH3_64, mapping.tensor, [5, 9])
    mapping.close()
    source = KVSource("shm", {"cuda_ipc": description, "blocks": blocks}, [0, 0], "xxh3_64",
                      8, (SHAPE[0], SHAPE[3], SHAPE[4], SHAPE[5]), "float32")
    transport = ShmPeerTransport("/tmp")
    _, sums = transport.load(source, 0, RankCaches((dst,)), [0, 1], ChecksumAlgo.XXH3_64)
    transport.close()
    assert sums == block_checksums(ChecksumAlgo.XXH3_64, dst, [0, 1])
    out.send({"how": mapping.how, "peek": peek, "sums": sums,
              "new_contexts": sorted(set(devices_with_context()) - set(before))})


@pytest.mark.processes
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("into", ["cuda:0", "cuda:1"], ids=["same-gpu", "across-gpus"])
def test_a_peer_process_maps_the_cache_into_its_own_context(into: str) -> None:
    """The blocks read through the mapping and pulled over `shm` are the shared ones; the map
    is the driver's into the receiver's context (not torch's on the sender's device), and a
    pull across GPUs with peer access creates no context on the sender's GPU."""
    if into == "cuda:1" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    cache = torch.randn(SHAPE, device="cuda:0")
    description = cuda_ipc.share(cache)
    assert description
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_map_in_child,
                                           args=(description, encode_blocks([5, 9]), into,
                                                 child))
    proc.start()
    child.close()  # the child's end closed here: its death reads as EOF, not a 120 s wait
    try:
        assert parent.poll(120), "the peer process did not answer"
        reply = parent.recv()
    finally:
        proc.join(30)
    want = block_checksums(ChecksumAlgo.XXH3_64, cache, [5, 9])
    assert reply["peek"] == want and reply["sums"] == want
    peers = into == "cuda:0" or torch.cuda.can_device_access_peer(1, 0)
    assert reply["how"] == (cuda_ipc.MAPPED if peers else cuda_ipc.TORCH)
    if peers:
        assert reply["new_contexts"] == []


_STAND_IN_LIBCUDA = r"""
/* The driver entry points cuda_driver.py binds, with the driver's own C signatures: what
   they receive is recorded, so the test reads what crossed the ABI. */
#include <string.h>
typedef struct { char reserved[64]; } CUipcMemHandle;
static int current = -1, retained = 0;
unsigned char seen_handle[64];
unsigned int seen_flags = 0, opened_in = 99;
unsigned long long closed = 0;
int cuInit(unsigned int flags) { return flags == 0 ? 0 : 1; }
int cuDeviceGet(int *device, int ordinal) { *device = 100 + ordinal; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int device) {
    retained++; *ctx = (void *)(long)(device * 16); return 0; }
int cuDevicePrimaryCtxRelease_v2(int device) { retained--; return device >= 100 ? 0 : 1; }
int cuDevicePrimaryCtxGetState(int device, unsigned int *flags, int *active) {
    *flags = 0; *active = device == 101; return 0; }
int cuCtxPushCurrent_v2(void *ctx) { current = (int)((long)ctx / 16) - 100; return 0; }
int cuCtxPopCurrent_v2(void **ctx) { *ctx = 0; current = -1; return 0; }
int cuIpcOpenMemHandle_v2(unsigned long long *address, CUipcMemHandle handle, unsigned int flags) {
    memcpy(seen_handle, handle.reserved, 64); seen_flags = flags; opened_in = current;
    *address = 0x7f0000001000ULL; return current >= 0 ? 0 : 201; }
int cuIpcCloseMemHandle(unsigned long long address) {
    closed = address; return current >= 0 ? 0 : 201; }
int cuGetErrorName(int code, const char **name) {
    *name = code == 201 ? "CUDA_ERROR_INVALID_CONTEXT" : "CUDA_ERROR_UNKNOWN"; return 0; }
int stand_in_retained(void) { return retained; }
"""


@pytest.mark.processes
def test_the_driver_binding_matches_the_drivers_c_signatures(tmp_path) -> None:
    """A stand-in libcuda compiled here from the driver's C prototypes: the handle arrives by
    value, byte for byte, with the lazy peer-access flag, in the receiver's context, and every
    retained context is released."""
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    source, library = tmp_path / "libcuda.c", tmp_path / "libcuda.so.1"
    source.write_text(_STAND_IN_LIBCUDA)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(source)],
                   check=True)
    lib = ctypes.CDLL(str(library))
    driver = cuda_driver.Driver(cuda_driver._resolve(lib))
    driver._call("init", 0)

    handle = bytes(range(7, 71))
    assert driver.open_ipc(handle, 1) == 0x7F00_0000_1000
    assert bytes((ctypes.c_ubyte * 64).in_dll(lib, "seen_handle")) == handle
    assert ctypes.c_uint.in_dll(lib, "seen_flags").value == cuda_driver.LAZY_ENABLE_PEER_ACCESS
    assert ctypes.c_uint.in_dll(lib, "opened_in").value == 1  # device 1's context was current
    driver.close_ipc(0x7F00_0000_1000, 1)
    assert ctypes.c_ulonglong.in_dll(lib, "closed").value == 0x7F00_0000_1000
    assert (driver.has_context(1), driver.has_context(0)) == (True, False)
    assert lib.stand_in_retained() == 0
    with pytest.raises(cuda_driver.CudaDriverError, match="CUDA_ERROR_INVALID_CONTEXT"):
        driver._call("ipc_close", ctypes.c_uint64(1))  # no context current: the driver's error


@pytest.mark.fast
def test_a_handle_is_mapped_once_per_device_however_many_use_it() -> None:
    """Two engines of one process (a tensor-parallel rank 0 and a peer pulling from the same
    ranks) share the driver's mapping; the last to close it unmaps it."""
    lib = _FakeLibcuda()
    driver = cuda_driver.Driver(cuda_driver._resolve(lib))  # type: ignore[arg-type]
    handle = bytes(range(1, 65))
    first = cuda_ipc._acquire(driver, handle, 0)
    assert cuda_ipc._acquire(driver, handle, 0) == first
    assert lib.log.count("cuIpcOpenMemHandle") == 1
    cuda_ipc._acquire(driver, handle, 1)  # another device's context: a mapping of its own
    assert lib.log.count("cuIpcOpenMemHandle") == 2
    cuda_ipc._unmap(driver, (handle, 0))
    assert "cuIpcCloseMemHandle" not in lib.log
    cuda_ipc._unmap(driver, (handle, 0))
    cuda_ipc._unmap(driver, (handle, 1))
    assert lib.log.count("cuIpcCloseMemHandle") == 2 and not cuda_ipc._MAPPED
