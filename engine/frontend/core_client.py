"""The serving side's link to its engine core: the same commands, a thread or a process away.

`ThreadCoreLink` runs `CoreLoop` on a thread of this process (the offline-style engine that
tests build, and `--no-engine-core-process`). `ProcessCoreLink` starts the core as a process
of its own (`engine/core/core_process.py`) and talks to it over two ZeroMQ `ipc://` sockets, so the
model's forward passes never hold the serving process's GIL.

Either way the link delivers every reply to `on_reply` on the event loop, in order, and calls
`on_dead` once if the core goes away without being asked to. Only the thread link loads the
core's modules (and torch): a serving process with its core in a process of its own does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from pdmesh.engine.core_protocol import (
    ENCODER,
    REPLY_DECODER,
    Call,
    Failed,
    Ready,
    Reply,
    Shutdown,
    tensor_from_frame,
    tensor_to_frame,
)
from pdmesh.engine.core_types import CoreInfo
from pdmesh.engine.worker.cpu_threads import core_environment
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.leftovers import CORE_DIR_PREFIX, pid_namespace, sweep_core_dirs

if TYPE_CHECKING:
    import torch

    from pdmesh.engine.config import EngineConfig
    from pdmesh.engine.core.core_loop import CommandQueue
    from pdmesh.engine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)

OnReply = Callable[[Reply, "torch.Tensor | None"], None]
OnDead = Callable[[str], None]


def core_dir_prefix() -> str:
    """This process's socket directories start with it."""
    return f"{CORE_DIR_PREFIX}{pid_namespace()}-{os.getpid()}-"


class _LoopTransport:
    """`CoreLoop`'s transport when the core runs on a thread: a queue in, the event loop out."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_reply: OnReply) -> None:
        self.commands: CommandQueue = queue.SimpleQueue()
        self._loop = loop
        self._on_reply = on_reply

    def receive(self, block: bool) -> list[tuple[Call, torch.Tensor | None]]:
        from pdmesh.engine.core.core_loop import take_queued

        return take_queued(self.commands, block)

    def send(self, reply: Reply, tensor: torch.Tensor | None = None) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._on_reply, reply, tensor)


class ThreadCoreLink:
    def __init__(self, core: EngineCore, on_reply: OnReply, on_dead: OnDead,
                 *, name: str = "engine") -> None:
        self.info: CoreInfo = core.info()
        self._transport = _LoopTransport(asyncio.get_running_loop(), on_reply)
        self._on_dead = on_dead
        self._closing = False
        self._thread = threading.Thread(target=self._run, args=(core,), name=name, daemon=True)
        self._thread.start()

    def _run(self, core: EngineCore) -> None:
        from pdmesh.engine.core.core_loop import CoreLoop

        try:
            CoreLoop(core, self._transport).run()
        except BaseException as exc:  # the loop itself broke: nothing will answer any more
            logger.exception("engine core thread died")
            if not self._closing:
                loop = self._transport._loop
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._on_dead, f"engine core thread died: {exc!r}")
        finally:
            core.close()

    def send(self, call: Call, tensor: torch.Tensor | None = None) -> None:
        self._transport.commands.put((call, tensor))

    async def join(self, timeout_s: float) -> None:
        self._closing = True
        await asyncio.to_thread(self._thread.join, timeout_s)


class ProcessCoreLink:
    """`ProcessCoreLink.launch()`, then `await link.boot(...)`: returns once the core is
    Ready."""

    def __init__(self) -> None:
        self.info: CoreInfo | None = None
        self._connector: KVConnectorConfig | None = None
        self._loop = asyncio.get_running_loop()
        if swept := sweep_core_dirs():
            logger.info("removed %d engine core socket dirs of dead processes", swept)
        # 0700: this user's sockets only. Named after this process, so that a sweep can tell
        # when its owner is gone.
        self._dir = tempfile.mkdtemp(prefix=core_dir_prefix())
        self._in_addr = f"ipc://{self._dir}/in"
        self._out_addr = f"ipc://{self._dir}/out"
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(self._in_addr)
        self._pull = self._actx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self._out_addr)
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._on_reply: OnReply | None = None
        self._on_dead: OnDead | None = None
        self._closing = False
        self._dead = False
        self._loop_thread = threading.get_ident()

    @classmethod
    def launch(cls) -> ProcessCoreLink:
        """Start the core's process (it imports torch meanwhile); `boot` tells it what to load.
        Split in two so the serving side can load its tokenizer while the core starts."""
        link = cls()
        # Its own session: a terminal's Ctrl-C or a signal to the service's process group must
        # reach the service (which drains) and not kill the core under it; the core still
        # dies with the service (PR_SET_PDEATHSIG) and stops on Shutdown.
        link._proc = subprocess.Popen(
            [sys.executable, "-m", "pdmesh.engine.core.core_process", link._in_addr,
            link._out_addr],
            stdin=subprocess.DEVNULL, start_new_session=True,
            env=core_environment(os.environ))
        return link

    async def boot(self, config: EngineConfig, eos_token_ids: set[int], on_reply: OnReply,
                   on_dead: OnDead, *, log_level: str = "WARNING",
                   timeout_s: float = 1800.0,
                   connector: KVConnectorConfig | None = None) -> None:
        """Until the core has loaded the model and is Ready (or failed: RuntimeError, and the
        process is gone)."""
        try:
            await self._boot(config, eos_token_ids, log_level, timeout_s, connector)
        except BaseException:
            await self.abandon()
            raise
        self._on_reply, self._on_dead = on_reply, on_dead
        self._reader = asyncio.ensure_future(self._read())
        threading.Thread(target=self._watch, name="engine-core-watch", daemon=True).start()

    async def abandon(self) -> None:
        """Kill a core that never became ready and clean up after it."""
        self.kill()
        await self.close(timeout_s=5.0)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def _boot(self, config: EngineConfig, eos: set[int], log_level: str,
                    timeout_s: float, connector: KVConnectorConfig | None) -> None:
        assert self._proc is not None, "launch() first"
        if connector is not None:  # its cache file is named after us (see cache_file.py)
            connector = replace(connector, owner_pid=os.getpid())
        self._connector = connector
        boot = {"config": asdict(config), "eos_token_ids": sorted(eos), "log_level": log_level,
                "connector": asdict(connector) if connector is not None else None}
        self._push.send(msgspec.json.encode(boot))
        deadline = self._loop.time() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"engine core exited with code {self._proc.returncode} "
                                   "while starting (see its log above)")
            if self._loop.time() > deadline:
                raise RuntimeError(f"engine core not ready after {timeout_s:.0f}s")
            if await self._pull.poll(500):
                reply = REPLY_DECODER.decode(await self._pull.recv())
                if isinstance(reply, Ready):
                    self.info = reply.info
                    return
                if isinstance(reply, Failed):
                    raise RuntimeError(reply.message)
                raise RuntimeError(f"engine core: unexpected {type(reply).__name__} at start-up")

    def send(self, call: Call, tensor: torch.Tensor | None = None) -> None:
        """Thread-safe: zmq sockets are not, so other threads hand over to the event loop."""
        if threading.get_ident() != self._loop_thread:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self.send, call, tensor)
            return
        if self._dead or (self._closing and not _is_shutdown(call)):
            return
        if tensor is None:
            self._push.send(ENCODER.encode(call), copy=False)
            return
        header, data = tensor_to_frame(tensor)
        call.tensor = header
        self._push.send_multipart([ENCODER.encode(call), data], copy=False)

    async def _read(self) -> None:
        assert self._on_reply is not None
        while True:
            try:
                frames = await self._pull.recv_multipart(copy=False)
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            try:
                reply = REPLY_DECODER.decode(frames[0].buffer)
                tensor = None
                header = getattr(reply, "tensor", None)
                if header is not None:
                    tensor = tensor_from_frame(header, frames[1].buffer)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError, IndexError) as exc:
                logger.error("engine core sent a malformed reply: %s", exc)
                continue
            self._on_reply(reply, tensor)

    def _watch(self) -> None:
        """Waits for the process; an exit nobody asked for is reported as the core's death."""
        assert self._proc is not None
        code = self._proc.wait()
        if self._closing:
            return
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._died, code)

    def _died(self, code: int) -> None:
        if self._dead or self._closing:
            return
        self._dead = True
        logger.error("engine core process exited unexpectedly (code %s)", code)
        if self._on_dead is not None:
            self._on_dead(f"engine core process exited with code {code}")

    async def join(self, timeout_s: float) -> None:
        """After `Shutdown` was sent: wait for the process to exit, then clean up."""
        self._closing = True
        await self.close(timeout_s)

    async def close(self, timeout_s: float) -> None:
        self._closing = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout_s)
            except TimeoutError:
                logger.warning("engine core did not exit in %.0fs; killing it", timeout_s)
                proc.kill()
                await asyncio.to_thread(proc.wait)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if not self._ctx.closed:
            self._ctx.destroy(linger=0)  # closes the sockets first: term() never blocks
            self._actx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)
        if self._connector is not None and self.info is not None and self.info.kv_cache_file:
            for name in self.info.kv_cache_file.split(","):  # a killed core's (ranks') caches
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(os.path.realpath(self._connector.shm_dir), name))

    def kill(self) -> None:
        """Tests and emergencies: the core dies at once (the link reports it as dead)."""
        if self._proc is not None:
            self._proc.kill()


def _is_shutdown(call: Call) -> bool:
    return isinstance(call.command, Shutdown)
