"""The other ranks of a tensor-parallel engine core: started, watched, stopped.

The engine core is rank 0: it schedules, holds its own shard and samples. Ranks 1..N-1 are
processes it starts at start-up (`python -m pdmesh.engine.core.rank_process`: a fresh
interpreter, never a fork of one whose torch threads are running), each told its rank and the
engine config in one JSON message on its stdin. All ranks then meet in a private directory's
file store (`join_group`) and load their shards side by side.

With a KV connector (the prefill and decode roles) every rank hands rank 0 its KV cache at
start-up (`rank_cache_share.py`: shm files on CPU, CUDA IPC handles on GPUs), so rank 0's
connector moves every rank's slice of a block itself and the ranks never hear of KV transfer.

A rank that exits while the engine runs is fatal to the engine: a thread per rank waits on
it and calls `on_failure` (the core process exits non-zero, so its serving process fails the
streams and the router migrates them, as for a dead core); so is a step that failed on rank 0
once the others had it (they could wait in a collective forever): the ranks are killed and
`on_failure` called. The ranks die with the core, three
ways: their collectives fail when rank 0's connections close, they exit when their stdin (a
pipe the core holds open for their lifetime) reaches its end, and, when the core started them
from its main thread, they ask for SIGKILL when it goes (PR_SET_PDEATHSIG, which follows the
thread that started a process, not the process: an engine built on another thread would lose
its ranks when that thread ended).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core.rank_cache_share import (
    CacheShare,
    SharedRanks,
    collect,
    plan_share,
    release,
)
from pdmesh.engine.core.startup import EngineSetup, resolve_engine_device, set_up_engine
from pdmesh.engine.worker.cpu_threads import core_environment, rank_threads, usable_cpus
from pdmesh.engine.worker.parallel.group import SINGLE, TensorParallel, join_group
from pdmesh.engine.worker.parallel.step_channel import StepChannel
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.leftovers import CORE_DIR_PREFIX, pid_namespace

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0
"""How long a closing engine waits for a rank to leave before it kills it."""


class RankBoot(msgspec.Struct):
    """The one message a rank process reads (its stdin, JSON)."""

    config: dict
    rank: int
    world_size: int
    store_path: str
    log_level: str = "WARNING"
    die_with_parent: bool = False  # PR_SET_PDEATHSIG: started from the core's main thread
    cache_file: str = ""  # CPU: the shm file this rank's KV cache lives in; empty: private
    shm_dir: str = ""
    share_ipc: bool = False  # CUDA: publish the cache's IPC handle (rank_cache_share.py)

    def cache_connector(self) -> KVConnectorConfig | None:
        """What the rank's set-up needs to put its cache in the file rank 0 named."""
        if not self.cache_file:
            return None
        return KVConnectorConfig(shm_dir=self.shm_dir, tcp=False)

    def cache_share(self) -> CacheShare:
        files = (self.cache_file,) if self.cache_file else ()
        return CacheShare(files, self.shm_dir, self.share_ipc)


@dataclass
class RankProcess:
    rank: int
    process: subprocess.Popen[bytes]


def rank_config(config: EngineConfig) -> EngineConfig:
    """`config` as each rank runs it: on CPU the engine's threads split over its ranks
    (ValueError when there are fewer threads than ranks)."""
    device = config.torch_device().type
    world = config.tensor_parallel_size
    # Unset: what torch starts with (OMP_NUM_THREADS, else every usable CPU); not torch's
    # count now, which an earlier engine of this process may have lowered.
    total = config.cpu_threads or int(os.environ.get("OMP_NUM_THREADS") or usable_cpus())
    if device == "cpu" and world > total:
        raise ValueError(f"tensor_parallel_size={world} exceeds the engine's {total} CPU "
                         "threads (each rank needs one; see --cpu-threads)")
    threads = rank_threads(config.cpu_threads if device == "cuda" else total, device, total,
                           world)
    return dataclasses.replace(config, cpu_threads=threads)


def set_up_with_ranks(config: EngineConfig, connector: KVConnectorConfig | None,
                      on_rank_failure: Callable[[str], None] | None,
                      ) -> tuple[EngineConfig, KVConnectorConfig | None, Ranks | None,
                                 EngineSetup]:
    """Rank 0's start-up: with tensor parallelism its other ranks are started first (and
    killed if its own set-up fails); the config rank 0 runs, the connector it runs
    (`plan_share`), its ranks, its set-up. With a connector rank 0 then reaches every rank's
    cache (`Ranks.shared`)."""
    ranks: Ranks | None = None
    if config.tensor_parallel_size > 1:
        config = rank_config(config)
        device = resolve_engine_device(config)
        connector, share_how = plan_share(connector, device, config.tensor_parallel_size)
        ranks = Ranks(config, device, on_rank_failure, share_how)
    try:
        setup = set_up_engine(config, connector, ranks.tp if ranks else SINGLE)
        if ranks is not None and ranks.share.active:
            ranks.shared = collect(ranks.share, ranks.directory, setup, ranks.tp)
            if ranks.shared is None:
                connector = None
    except BaseException:
        if ranks is not None:
            ranks.kill()
        raise
    return config, connector, ranks, setup


def rank_device(device: torch.device, rank: int, world_size: int) -> str:
    """The device of `rank` as a `--device` value: consecutive CUDA devices from the
    engine's own (ValueError when there are not enough), the CPU for every rank on CPU."""
    if device.type != "cuda":
        return device.type
    index = (device.index or 0) + rank
    count = torch.cuda.device_count()
    if (device.index or 0) + world_size > count:
        raise ValueError(f"tensor_parallel_size={world_size} from {device} needs "
                         f"{world_size} CUDA devices; {count} are visible")
    return f"cuda:{index}"


class Ranks:
    """Ranks 1..N-1 of an engine core, and rank 0's end of the group (`tp`, `channel`)."""

    def __init__(self, config: EngineConfig, device: torch.device,
                 on_failure: Callable[[str], None] | None = None,
                 share: CacheShare | None = None) -> None:
        """Start the ranks and join the group with them (blocks until they all joined).
        `on_failure(reason)`: called when a rank exits before `close` (on a watcher thread)
        or a step fails; None only logs it (every later step then raises). `share`: how the
        ranks hand rank 0 their KV caches (none without a connector)."""
        world = config.tensor_parallel_size
        self.share = share = share or CacheShare()
        self.shared: SharedRanks | None = None  # every rank's cache, once `collect` ran
        # 0700: the group's rendezvous, named like a core's socket directory (this pid), so
        # the sweep of a dead process's leftovers removes it after a SIGKILL too
        self.directory = tempfile.mkdtemp(
            prefix=f"{CORE_DIR_PREFIX}{pid_namespace()}-{os.getpid()}-tp")
        store = os.path.join(self.directory, "store")
        self._closing = threading.Event()
        self._on_failure = on_failure
        self.dead: tuple[int, int] | None = None  # (rank, exit code) of a rank that died
        self.procs: list[RankProcess] = []
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        raw = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        main_thread = threading.current_thread() is threading.main_thread()
        try:
            rank_device(device, world - 1, world)  # enough devices for all of them
            for rank in range(1, world):
                raw["device"] = rank_device(device, rank, world)
                boot = RankBoot(dict(raw), rank, world, store, str(level), main_thread,
                                share.files[rank - 1] if share.files else "", share.shm_dir,
                                share.ipc)
                proc = subprocess.Popen(
                    [sys.executable, "-m", "pdmesh.engine.core.rank_process"],
                    stdin=subprocess.PIPE, env=core_environment(os.environ))
                self.procs.append(RankProcess(rank, proc))
                assert proc.stdin is not None
                proc.stdin.write(msgspec.json.encode(boot) + b"\n")  # kept open: see above
                proc.stdin.flush()
                threading.Thread(target=self._watch, args=(rank, proc), daemon=True,
                                 name=f"tp-rank-{rank}-watch").start()
            self.tp: TensorParallel = join_group(store, 0, world, device,
                                                 alive=lambda: self.dead is None)
        except BaseException:
            self.kill()
            raise
        self.channel = StepChannel(self.tp, device, on_broken=self._step_failed)
        atexit.register(self.kill)  # an engine never closed (a dropped offline LLM)
        logger.info("tensor parallel: %d ranks (pids %s)", world,
                    [p.process.pid for p in self.procs])

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if self._closing.is_set():
            return
        self.dead = (rank, code)
        reason = f"tensor-parallel rank {rank} exited (code {code})"
        logger.error("%s: the engine cannot step", reason)
        channel = getattr(self, "channel", None)
        if channel is not None:
            channel.broken = reason  # every later step raises (not a collective's wait)
        if self._on_failure is not None:
            self._on_failure(reason)

    def _step_failed(self, reason: str) -> None:
        """A step failed with its inputs sent: the ranks are out of step, so end them."""
        logger.error("tensor parallel: a step failed (%s); the ranks are stopped", reason)
        self.kill()
        if self._on_failure is not None:
            self._on_failure(f"a tensor-parallel step failed: {reason}")

    def close(self) -> None:
        """Stop the ranks (asked over the channel, killed if they do not leave) and remove
        the rendezvous directory."""
        if self._closing.is_set():
            return
        channel = getattr(self, "channel", None)
        if channel is None or self.dead is not None:
            self.kill()  # a group that cannot carry STOP
            return
        self._closing.set()
        atexit.unregister(self.kill)
        with contextlib.suppress(Exception):  # a broken group: the ranks are killed below
            channel.send_stop()
        for p in self.procs:
            try:
                p.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.process.send_signal(signal.SIGKILL)
                p.process.wait()
        self._release()

    def kill(self) -> None:
        """Kill the ranks at once (the engine failed to start: they may be waiting in a
        collective that will never complete)."""
        self._closing.set()
        atexit.unregister(self.kill)
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                p.process.send_signal(signal.SIGKILL)
            p.process.wait()
        self._release()

    def _release(self) -> None:
        """The ranks are gone: close their stdin pipes, remove the rendezvous directory, and
        undo the caches' sharing (`rank_cache_share.release`)."""
        for p in self.procs:
            if p.process.stdin is not None:
                with contextlib.suppress(OSError):
                    p.process.stdin.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        release(self.share, self.shared)


def exit_on_rank_failure(reason: str) -> None:
    """The engine core process's `on_failure`: exit non-zero now (on NCCL a step blocked on a
    dead rank's collective would wait for it forever)."""
    logger.error("engine core exits: %s", reason)
    os._exit(1)
