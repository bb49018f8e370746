"""The few CUDA driver calls the KV connector needs that torch does not offer: mapping a peer
process's IPC memory handle into *this* device's context, and asking which devices this process
holds a context on.

torch opens an IPC handle with the allocation's own device current (`_new_shared_cuda`). For a
receiver on another GPU that creates a CUDA context on the sender's GPU inside the receiving
process: hundreds of MiB of that GPU's memory, outside its engine's budget, once per receiving
process (and, in a tensor-parallel core, rank 0 would hold one on every rank's GPU). The driver
can map the handle into the receiver's own context instead and reach the bytes over peer access
(NVLink, PCIe P2P), as UCX's cuda_ipc transport does.

libcuda is loaded with ctypes: it is wherever a driver is, whatever CUDA runtime torch was built
with. No driver, or a call that fails: `driver()` is None or the call raises `CudaDriverError`,
and the caller keeps torch's opener.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)

IPC_HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)
LAZY_ENABLE_PEER_ACCESS = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS

_c_int_p = ctypes.POINTER(ctypes.c_int)


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


# (name, candidate symbols newest first, argument types): every call returns a CUresult.
_PROTOTYPES: tuple[tuple[str, tuple[str, ...], tuple[object, ...]], ...] = (
    ("init", ("cuInit",), (ctypes.c_uint,)),
    ("device_get", ("cuDeviceGet",), (_c_int_p, ctypes.c_int)),
    ("retain", ("cuDevicePrimaryCtxRetain",), (ctypes.POINTER(ctypes.c_void_p), ctypes.c_int)),
    ("release", ("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"),
     (ctypes.c_int,)),
    ("state", ("cuDevicePrimaryCtxGetState",),
     (ctypes.c_int, ctypes.POINTER(ctypes.c_uint), _c_int_p)),
    ("push", ("cuCtxPushCurrent_v2", "cuCtxPushCurrent"), (ctypes.c_void_p,)),
    ("pop", ("cuCtxPopCurrent_v2", "cuCtxPopCurrent"), (ctypes.POINTER(ctypes.c_void_p),)),
    ("ipc_open", ("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"),
     (ctypes.POINTER(ctypes.c_uint64), _IpcMemHandle, ctypes.c_uint)),
    ("ipc_close", ("cuIpcCloseMemHandle",), (ctypes.c_uint64,)),
    ("error_name", ("cuGetErrorName",), (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))),
)


class CudaDriverError(RuntimeError):
    """A driver call that did not return CUDA_SUCCESS."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.code = code


@dataclass(frozen=True)
class Driver:
    """libcuda's entry points this module uses, resolved once."""

    calls: dict[str, Callable[..., int]]

    def _call(self, name: str, *args: object) -> None:
        code = int(self.calls[name](*args))
        if code != 0:
            raise CudaDriverError(name, code, self._error_name(code))

    def _error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        if int(self.calls["error_name"](code, ctypes.byref(text))) == 0 and text.value:
            return text.value.decode(errors="replace")
        return "CUDA_ERROR"

    def _device(self, ordinal: int) -> ctypes.c_int:
        device = ctypes.c_int()
        self._call("device_get", ctypes.byref(device), ordinal)
        return device

    @contextlib.contextmanager
    def primary_context(self, ordinal: int) -> Iterator[None]:
        """The device's primary context (the one torch's runtime uses) current on this thread
        for the block, whatever was current before (a connector thread may have none)."""
        device = self._device(ordinal)
        context = ctypes.c_void_p()
        self._call("retain", ctypes.byref(context), device)
        try:
            self._call("push", context)
            try:
                yield
            finally:
                self._call("pop", ctypes.byref(ctypes.c_void_p()))
        finally:
            self._call("release", device)

    def open_ipc(self, handle: bytes, ordinal: int) -> int:
        """Map a peer's allocation (its 64-byte cudaIpcMemHandle) into device `ordinal`'s
        context; the base address. Peer access to the allocation's GPU is enabled as needed."""
        if len(handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"an IPC memory handle is {IPC_HANDLE_BYTES} bytes, "
                             f"not {len(handle)}")
        raw = _IpcMemHandle.from_buffer_copy(handle)  # by value, as the driver takes it
        address = ctypes.c_uint64()
        with self.primary_context(ordinal):
            self._call("ipc_open", ctypes.byref(address), raw, LAZY_ENABLE_PEER_ACCESS)
        return int(address.value)

    def close_ipc(self, address: int, ordinal: int) -> None:
        with self.primary_context(ordinal):
            self._call("ipc_close", ctypes.c_uint64(address))

    def has_context(self, ordinal: int) -> bool:
        """Whether this process holds an active primary context on device `ordinal`."""
        flags, active = ctypes.c_uint(), ctypes.c_int()
        self._call("state", self._device(ordinal), ctypes.byref(flags), ctypes.byref(active))
        return bool(active.value)


def _resolve(lib: ctypes.CDLL) -> dict[str, Callable[..., int]]:
    calls: dict[str, Callable[..., int]] = {}
    for name, symbols, argtypes in _PROTOTYPES:
        for symbol in symbols:
            func = getattr(lib, symbol, None)
            if func is not None:
                func.argtypes = list(argtypes)
                func.restype = ctypes.c_int
                calls[name] = func
                break
        else:
            raise AttributeError(f"libcuda has no {symbols[0]}")
    return calls


@functools.cache
def driver() -> Driver | None:
    """libcuda, initialised; None where there is no driver (a CPU host) or it lacks a call."""
    try:
        found = Driver(_resolve(ctypes.CDLL("libcuda.so.1")))
        found._call("init", 0)
    except (OSError, AttributeError, CudaDriverError) as exc:
        logger.debug("the CUDA driver API is not usable here: %s", exc)
        return None
    return found
