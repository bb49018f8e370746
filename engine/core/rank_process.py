"""A tensor-parallel rank other than the first: `python -m pdmesh.engine.core.rank_process`.

Started by the engine core (engine/core/ranks.py) with a `RankBoot` JSON message on stdin.
It builds what the core builds of its own shard (engine/core/startup.py: the model's slice,
a KV cache of its heads, sized as the core's), then runs every step the core sends
(engine/worker/parallel/step_channel.py) until told to stop. It schedules and samples
nothing. It exits with the core: when a collective fails (the core's connections closed), when
its stdin ends (the core holds the pipe open while it lives) and, where the core asked for it,
by PR_SET_PDEATHSIG.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading

import msgspec

from pdmesh.engine.core.core_process import engine_config_from
from pdmesh.engine.core.rank_cache_share import publish
from pdmesh.engine.core.ranks import RankBoot
from pdmesh.engine.core.startup import resolve_engine_device, set_up_engine
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.worker.model_runner import ModelRunner
from pdmesh.engine.worker.parallel.group import join_group
from pdmesh.engine.worker.parallel.step_channel import Op, StepChannel
from pdmesh.kernels.backend_selection import get_attention_backend

logger = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the engine core exits (prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def serve_rank(boot: RankBoot) -> None:
    """Join the group, set up this rank's shard and run steps until STOP."""
    config = engine_config_from(boot.config)
    device = resolve_engine_device(config)
    tp = join_group(boot.store_path, boot.rank, boot.world_size, device)
    setup = set_up_engine(config, boot.cache_connector(), tp, boot.cache_file)
    publish(boot.cache_share(), os.path.dirname(boot.store_path), setup, tp)
    kv = KVCacheManager(setup.num_blocks, setup.scheme, False)
    runner = ModelRunner(
        setup.model, setup.kv_cache, kv,
        get_attention_backend(config.attention_backend, device, block_size=config.block_size),
        device, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, enforce_eager=True,
        max_model_len=setup.max_model_len)
    channel = StepChannel(tp, device)
    while True:
        message = channel.receive()
        if message.op is Op.STOP:
            return
        if message.op is Op.COPY:
            assert message.copies is not None
            runner.copy_blocks(message.copies)
            continue
        assert message.inputs is not None
        runner.execute(message.inputs)


def _exit_when_stdin_ends() -> None:
    """The core holds this process's stdin open while it lives: its end is the core's. (The
    file descriptor, not `sys.stdin`: a daemon thread blocked inside the buffered reader
    would abort the interpreter's shutdown.)"""
    while os.read(0, 4096):
        pass
    os._exit(1)


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):  # the engine core decides when we stop
        signal.signal(sig, signal.SIG_IGN)
    boot = msgspec.json.decode(sys.stdin.buffer.readline(), type=RankBoot)
    if boot.die_with_parent:
        _die_with_parent()
    threading.Thread(target=_exit_when_stdin_ends, daemon=True, name="core-watch").start()
    logging.basicConfig(level=boot.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s tp-rank-{boot.rank} %(name)s: "
                               "%(message)s")
    try:
        serve_rank(boot)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", boot.rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
