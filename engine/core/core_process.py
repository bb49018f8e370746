"""The engine core's own process: `python -m pdmesh.engine.core.core_process IN_ADDR OUT_ADDR`.

The serving process starts it, binds two ZeroMQ `ipc://` sockets in a private (0700)
directory, and sends one JSON `Boot` message with the engine configuration and the EOS ids
(its tokenizer's). The core loads the model, answers `Ready` with its static facts, and runs
`CoreLoop` until `Shutdown`. Messages are msgpack through msgspec; tensors travel as raw
frames checked against their headers; nothing is unpickled.

The core exits by itself when its parent goes away (PR_SET_PDEATHSIG, and a parent check
while idle), so a killed service never leaves an engine holding the accelerator.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from dataclasses import fields, replace
from typing import Any

import msgspec
import torch
import zmq

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core.core_loop import CoreLoop
from pdmesh.engine.core.engine_core import EngineCore
from pdmesh.engine.core.ranks import exit_on_rank_failure
from pdmesh.engine.core_protocol import (
    CALL_DECODER,
    ENCODER,
    Call,
    Failed,
    Ready,
    Reply,
    tensor_from_frame,
    tensor_to_frame,
)
from pdmesh.engine.core_types import EngineLoadSnapshot
from pdmesh.engine.worker.cpu_threads import core_threads, usable_cpus
from pdmesh.gc_heap import freeze_startup_heap
from pdmesh.kvstore.connector.config import KVConnectorConfig

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000
"""While idle, how often the core checks that its parent is still there."""


class Boot(msgspec.Struct):
    config: dict[str, Any]
    eos_token_ids: list[int]
    log_level: str = "WARNING"
    connector: dict[str, Any] | None = None  # KVConnectorConfig: the engine services' cores


def engine_config_from(raw: dict[str, Any]) -> EngineConfig:
    """EngineConfig from the boot message: known fields only, validated by the dataclass."""
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"engine config: unknown fields {unknown}")
    return EngineConfig(**raw)


class ZmqCoreTransport:
    """The core's side of the two sockets."""

    def __init__(self, ctx: zmq.Context, in_addr: str, out_addr: str) -> None:
        self._in = ctx.socket(zmq.PULL)
        self._in.connect(in_addr)
        self._out = ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 2000)
        self._out.connect(out_addr)
        self._parent = os.getppid()

    def receive_boot(self) -> Boot:
        while not self._in.poll(IDLE_POLL_MS):
            self._check_parent()
        return msgspec.json.decode(self._in.recv(), type=Boot)

    def receive(self, block: bool) -> list[tuple[Call, torch.Tensor | None]]:
        calls: list[tuple[Call, torch.Tensor | None]] = []
        if block:
            while not self._in.poll(IDLE_POLL_MS):
                self._check_parent()
        while True:
            try:
                frames = self._in.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return calls
            try:
                call = CALL_DECODER.decode(frames[0].buffer)
                tensor = None
                if call.tensor is not None:
                    if len(frames) != 2:
                        raise ValueError("a tensor header without its frame")
                    tensor = tensor_from_frame(call.tensor, frames[1].buffer)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                logger.error("dropped a malformed command: %s", exc)
                continue
            calls.append((call, tensor))

    def send(self, reply: Reply, tensor: torch.Tensor | None = None) -> None:
        if tensor is None:
            self._out.send(ENCODER.encode(reply), copy=False)
            return
        header, data = tensor_to_frame(tensor)
        reply.tensor = header  # type: ignore[union-attr]
        self._out.send_multipart([ENCODER.encode(reply), data], copy=False)

    def _check_parent(self) -> None:
        if os.getppid() != self._parent:
            logger.warning("engine core: the serving process is gone; exiting")
            os._exit(1)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the parent exits (prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m pdmesh.engine.core.core_process IN_ADDR OUT_ADDR", file=sys.stderr)
        return 2
    _die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the serving process decides when we stop
        signal.signal(sig, signal.SIG_IGN)
    ctx = zmq.Context()
    transport = ZmqCoreTransport(ctx, args[0], args[1])
    boot = transport.receive_boot()
    logging.basicConfig(level=boot.log_level.upper(),
                        format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s")
    try:
        config = engine_config_from(boot.config)
        threads = core_threads(config.cpu_threads, config.torch_device().type, usable_cpus())
        config = replace(config, cpu_threads=threads)
        logger.info("engine core: %s torch threads", threads or torch.get_num_threads())
        connector = (None if boot.connector is None
                     else msgspec.convert(boot.connector, KVConnectorConfig))
        core = EngineCore(config, boot.eos_token_ids, connector,
                          on_rank_failure=exit_on_rank_failure)
    except Exception as exc:
        logger.exception("engine core failed to start")
        transport.send(Failed([], f"engine core failed to start: {exc}", EngineLoadSnapshot()))
        ctx.destroy(linger=2000)
        return 1
    freeze_startup_heap()  # the model, torch and the core's state: no more GC scans of them
    transport.send(Ready(core.info()))
    try:
        CoreLoop(core, transport).run()
    finally:
        core.close()
    ctx.destroy(linger=2000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
