"""The tensor-parallel group: this rank, the world, and the few collectives the model uses.

A group is made straight from a `torch.distributed` store and backend (gloo on CPU, NCCL on
CUDA, with a gloo group beside it for the step channel's headers: `broadcast_host`) rather
than through `init_process_group`, so no process-global default group exists:
an offline `LLM` with tensor parallelism leaves `torch.distributed` of its host process as it
found it. A single-rank group (`SINGLE`) makes every collective a no-op, so the model runs the
same code at every size and at size 1 exactly the ops it ran before tensor parallelism.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

JOIN_TIMEOUT_S = 300.0
"""How long a rank waits at start-up for the others to join the group."""

COLLECTIVE_TIMEOUT = timedelta(days=365)
"""Collectives never time out in practice: an idle engine's ranks wait in the broadcast of
the next step for as long as the engine is idle. A rank that is gone is found by its process
(the core's watcher threads, the ranks' PR_SET_PDEATHSIG; gloo's collectives also fail at
once on a closed connection), never by a timeout (engine/core/ranks.py)."""

JOIN_POLL = timedelta(seconds=0.5)
"""While ranks join: how often the waiting one checks that the others are still alive."""


@dataclass
class CollectiveTimes:
    """Wall seconds and calls of this process's collectives, by kind ("all_reduce", "gather",
    "broadcast"), from launch to completion, so waiting for a slower rank counts: how a
    benchmark tells a step's communication from its compute (bench/tp_step.py). Recorded
    only while installed with `record_collectives`; a single rank has none to record."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    clock: Callable[[], float] = time.perf_counter

    def add(self, kind: str, started: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + self.clock() - started
        self.calls[kind] = self.calls.get(kind, 0) + 1

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


_recording: CollectiveTimes | None = None


def record_collectives(times: CollectiveTimes | None) -> CollectiveTimes | None:
    """Time this process's collectives into `times` from now on (None: stop); returns the
    recorder it replaces. Off by default, when a collective only reads this module's
    `_recording` and times nothing. Not for concurrent steps: every thread's collectives go
    to the one recorder."""
    global _recording
    previous, _recording = _recording, times
    return previous


@dataclass(frozen=True)
class TensorParallel:
    """One rank's view of its tensor-parallel group."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None for a single rank
    control: Any = None
    """A gloo group for host tensors beside an NCCL `group` (None: `group` is gloo)."""

    @property
    def is_first(self) -> bool:
        """The rank that schedules and samples (the engine core's own process)."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` over the ranks in place (sum, or min); returns it."""
        if self.world_size == 1:
            return tensor
        times = _recording
        started = times.clock() if times is not None else 0.0
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.SUM
        self.group.allreduce([tensor], opts).wait()
        if times is not None:
            times.add("all_reduce", started)
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` of the first rank, in place on every rank (on the group's device)."""
        return self._broadcast(self.group, tensor)

    def broadcast_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`, a host tensor, of the first rank, in place on every rank, over a CPU
        group. What an idle rank waits in: on NCCL that wait would keep a kernel spinning on
        its GPU and its thread spinning in a stream synchronize for as long as the engine is
        idle; a gloo wait sleeps."""
        return self._broadcast(self.control if self.control is not None else self.group,
                               tensor)

    def _broadcast(self, group: Any, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        times = _recording
        started = times.clock() if times is not None else 0.0
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([tensor], opts).wait()
        if times is not None:
            times.add("broadcast", started)
        return tensor

    def gather_columns(self, tensor: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Each rank's `[rows, widths[r]]` slice side by side on the first rank (None
        elsewhere). Slices may differ in width (an uneven split): each is padded to the widest
        for the collective and trimmed after."""
        if self.world_size == 1:
            return tensor
        times = _recording
        started = times.clock() if times is not None else 0.0
        widest = max(widths)
        if tensor.shape[1] < widest:
            tensor = torch.nn.functional.pad(tensor, (0, widest - tensor.shape[1]))
        tensor = tensor.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if not self.is_first:
            self.group.gather([], [tensor], opts).wait()
            if times is not None:
                times.add("gather", started)
            return None
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.group.gather([parts], [tensor], opts).wait()
        whole = torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], dim=1)
        if times is not None:
            times.add("gather", started)
        return whole


SINGLE = TensorParallel()
"""The group of an engine without tensor parallelism."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_group(store_path: str, rank: int, world_size: int, device: torch.device,
               join_timeout_s: float = JOIN_TIMEOUT_S,
               alive: Callable[[], bool] | None = None) -> TensorParallel:
    """Join the group whose ranks meet at `store_path` (a file in a private directory of the
    first rank's); blocks until every rank has joined (RuntimeError after `join_timeout_s`,
    or as soon as `alive()` says a rank that has not joined yet is gone). Same host only:
    gloo talks over the loopback interface."""
    if world_size == 1:
        return SINGLE
    store = dist.FileStore(store_path, world_size)
    _wait_for_ranks(store, rank, world_size, join_timeout_s, alive)
    if backend_for(device) == "nccl":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = COLLECTIVE_TIMEOUT
        group = dist.ProcessGroupNCCL(dist.PrefixStore("group", store), rank, world_size, opts)
        # The NCCL group connects at its first collective; the gloo one, here, once all join.
        control = _gloo_group(dist.PrefixStore("control", store), rank, world_size)
        return TensorParallel(rank, world_size, group, control)
    return TensorParallel(rank, world_size,
                          _gloo_group(dist.PrefixStore("group", store), rank, world_size))


def _gloo_group(store: dist.Store, rank: int, world_size: int) -> Any:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = COLLECTIVE_TIMEOUT
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def _wait_for_ranks(store: dist.Store, rank: int, world_size: int, timeout_s: float,
                    alive: Callable[[], bool] | None) -> None:
    """Say this rank is here, then wait until every rank said so."""
    store.set(f"joined/{rank}", "1")
    keys = [f"joined/{r}" for r in range(world_size)]
    waited = timedelta()
    while True:
        try:
            store.wait(keys, JOIN_POLL)
            return
        except RuntimeError:  # this poll timed out (torch's DistStoreError is one)
            waited += JOIN_POLL
        if alive is not None and not alive():
            raise RuntimeError("tensor parallel: a rank exited before it joined the group")
        if waited.total_seconds() >= timeout_s:
            raise RuntimeError(f"tensor parallel: the ranks did not all join within "
                               f"{timeout_s:.0f} s")
