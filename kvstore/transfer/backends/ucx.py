"""UCX data plane through the `ucxx` package (RAPIDS' successor of ucx-py).

UCX picks the fastest transport between the two processes (shared memory, TCP, RDMA, CUDA
IPC/NVLink for device buffers). Messages are tagged sends of exact sizes: a fixed request
frame (transfer id + token), the header length, the header, the payload received straight
into the destination tensor, and a one-byte "done" from the receiver before either side
closes. Without explicit configuration, CPU-only hosts use `UCX_TLS=tcp,self,sm`; set
UCX_* environment variables to override. (With the PyPI wheels on the dev box UCX picks
tcp over loopback even between local processes, so this backend is slower than tcp/shm
there; it is meant for RDMA and GPU hosts, and `auto` offers it only there: `ucx_tcp_only`.)

Optional: install `ucxx-cu12` (+ `libucxx-cu12`, `libucx-cu12`, `librmm-cu12`,
`rapids-logger`, `nvidia-ml-py`) with --no-deps; the backend is offered only when it imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from pdmesh.kvstore.transfer.backends.availability import ucx_tcp_only, ucxx_unavailable_reason
from pdmesh.kvstore.transfer.backends.base import DataPlaneClient, DataPlaneServer
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import (
    KVSenderUnavailable,
    KVTransferError,
    KVTransferTimeout,
    KVWireError,
)
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.lease import Grant
from pdmesh.kvstore.transfer.wire import MAX_HEADER_BYTES, check_header, decode_header

logger = logging.getLogger(__name__)

_REQUEST = struct.Struct("<4s32s32s")  # magic, transfer id, token (both 32 hex chars)
_REQUEST_MAGIC = b"PDKU"
_LENGTH = struct.Struct("<Q")


unavailable_reason = ucxx_unavailable_reason


@functools.cache
def ucxx_runtime() -> Any:
    """Import and initialise UCX once per process, on first use (it starts worker threads);
    the engine core's own UCX transport (`connector/ucx_blocks.py`) shares it."""
    import ucxx

    options = {"WARN_UNUSED_ENV_VARS": "n"}  # ucxx itself sets UCX_MEMTYPE_CACHE
    if ucx_tcp_only(torch.cuda.is_available()):
        options["TLS"] = "tcp,self,sm"
    with contextlib.suppress(RuntimeError):  # already initialised: keep the owner's settings
        ucxx.init(options=options, env_takes_precedence=True)
    return ucxx


def _bytes_of(tensor: torch.Tensor) -> Any:
    """A buffer ucxx accepts, sharing memory with `tensor` (host: numpy, device: tensor)."""
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()


class Server(DataPlaneServer):
    name = "ucxx"

    async def start(self) -> None:
        ucxx = ucxx_runtime()
        self._loop = asyncio.get_running_loop()
        self._streams = asyncio.Semaphore(self.config.max_streams)
        self._listener = ucxx.create_listener(self._serve, port=0)

    async def prepare(self, grant: Grant) -> dict[str, str]:
        return {
            "host": self.config.advertise_host,
            "port": str(self._listener.port),
            "token": grant.token,
        }

    async def close(self) -> None:
        self._listener.close()

    async def _serve(self, ep: Any) -> None:
        timeout = self.config.io_timeout_s
        try:
            async with self._streams:
                request = np.empty(_REQUEST.size, dtype=np.uint8)
                await asyncio.wait_for(ep.recv(request), timeout)
                magic, tid, token = _REQUEST.unpack(request.tobytes())
                if magic != _REQUEST_MAGIC:
                    raise KVWireError("bad ucxx data-plane request")
                abort = functools.partial(self._loop.call_soon_threadsafe, ep.abort)
                with self.table.reading(tid.decode(), token.decode(), abort=abort) as src:
                    header = np.frombuffer(bytearray(src.header), dtype=np.uint8)
                    length = np.frombuffer(bytearray(_LENGTH.pack(len(header))), dtype=np.uint8)
                    await asyncio.wait_for(ep.send(length), timeout)
                    await asyncio.wait_for(ep.send(header), timeout)
                    await asyncio.wait_for(ep.send(_bytes_of(src.kv)), timeout)
                    # A send may complete before the peer has all fragments; closing now can
                    # reset the connection under them. The receiver says when it is done.
                    await asyncio.wait_for(ep.recv(np.empty(1, dtype=np.uint8)), timeout)
        except (TimeoutError, KVTransferError, UnicodeDecodeError) as exc:
            logger.debug("ucxx send ended early: %s", exc)
        except Exception as exc:  # ucxx raises its own error types when a peer vanishes
            logger.debug("ucxx send failed: %r", exc)
        finally:
            await _close(ep)


class Client(DataPlaneClient):
    name = "ucxx"

    async def receive(
        self,
        handle: KVHandle,
        params: Mapping[str, str],
        out: torch.Tensor,
        deadline: Deadline,
    ) -> None:
        ucxx = ucxx_runtime()
        host, port = params["host"], int(params["port"])
        try:
            ep = await asyncio.wait_for(ucxx.create_endpoint(host, port), deadline.remaining())
        except TimeoutError:
            raise KVTransferTimeout(
                "ucxx connect timed out", transfer_id=handle.transfer_id
            ) from None
        except Exception as exc:
            raise KVSenderUnavailable(
                f"ucxx connect to {host}:{port} failed: {exc!r}", transfer_id=handle.transfer_id
            ) from exc
        try:
            await asyncio.wait_for(self._pull(ep, handle, params["token"], out),
                                   deadline.remaining())
        except TimeoutError:
            ep.abort()  # cancels the posted receive before `out` is handed back
            raise KVTransferTimeout(
                "ucxx receive timed out", transfer_id=handle.transfer_id
            ) from None
        except asyncio.CancelledError:
            ep.abort()
            raise
        except KVTransferError:
            ep.abort()
            raise
        except Exception as exc:
            ep.abort()
            raise KVSenderUnavailable(
                f"ucxx receive from {host}:{port} failed: {exc!r}", transfer_id=handle.transfer_id
            ) from exc
        await _close(ep)

    @staticmethod
    async def _pull(ep: Any, handle: KVHandle, token: str, out: torch.Tensor) -> None:
        request = _REQUEST.pack(_REQUEST_MAGIC, handle.transfer_id.encode(), token.encode())
        await ep.send(np.frombuffer(bytearray(request), dtype=np.uint8))
        length = np.empty(_LENGTH.size, dtype=np.uint8)
        await ep.recv(length)
        (header_len,) = _LENGTH.unpack(length.tobytes())
        if not 0 < header_len <= MAX_HEADER_BYTES:
            raise KVWireError(f"ucxx header length {header_len} out of range")
        header = np.empty(header_len, dtype=np.uint8)
        await ep.recv(header)
        check_header(decode_header(header.tobytes()), handle)
        await ep.recv(_bytes_of(out))
        await ep.send(np.ones(1, dtype=np.uint8))


async def _close(ep: Any) -> None:
    try:
        await ep.close()
    except Exception as exc:
        logger.debug("ucxx endpoint close: %r", exc)
