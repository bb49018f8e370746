"""The torch_dist transport's process groups, one per sender–receiver pair of cores, kept
between pulls (`dist_blocks.py` moves the bytes over them).

Making a group is the expensive part of a torch_dist pull: a TCPStore rendezvous, gloo's
connections, and on GPUs an NCCL communicator (bootstrap, topology, channels: hundreds of
milliseconds and more), several times what a prompt's blocks take over NVLink. So the first
pull between two cores makes one, both keep it under an id the sender chose, and the next
pull names it and goes straight to the bytes. A group carries one pull at a time (NCCL
matches point-to-point operations in the order they are issued, not by tag): each side takes
it out of its registry for the pull and gives it back only after a pull that ended well, so a
pull that fails (a timeout, a peer gone, a refused request) closes it on that side, and the
other side, asked next time for an id it no longer holds (or naming one the peer dropped),
makes a new one. Bounded: the least recently used group goes beyond `MAX_GROUPS` (a receiver
pulls from a few prefill engines, a sender serves a few decode engines), and a group unused
for `IDLE_S` is closed (its peer died, or stopped pulling: an NCCL communicator keeps buffers on
the device).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

MAX_GROUPS = 16
"""Groups kept per registry; each holds sockets (gloo) or an NCCL communicator's buffers."""
IDLE_S = 600.0
"""A kept group unused this long is closed when the registry is next used."""


@dataclass
class PairGroup:
    """A two-rank group between one sender core (rank 0) and one receiver core (rank 1)."""

    group_id: str  # the sender's name for it; "" for a group used by one pull only
    kind: str      # "gloo" or "nccl"
    group: torch.distributed.ProcessGroup
    store: torch.distributed.Store  # kept: NCCL makes its communicator on first use, via it

    def close(self) -> None:
        """Tear the group down (a failed collective may have done so already)."""
        shutdown = getattr(self.group, "shutdown", None) or getattr(self.group, "abort", None)
        if callable(shutdown):
            with contextlib.suppress(RuntimeError):
                shutdown()


def new_group_id() -> str:
    return secrets.token_hex(16)


class PairGroups:
    """Kept groups by key (the sender: the group's id; a receiver: the sender's address),
    each out of the registry while a pull uses it."""

    def __init__(self, limit: int = MAX_GROUPS, idle_s: float = IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._groups: OrderedDict[str, tuple[PairGroup, float]] = OrderedDict()  # given back at
        self._limit, self._idle_s, self._clock = limit, idle_s, clock
        self._lock = threading.Lock()
        self._closed = False

    def take(self, key: str) -> PairGroup | None:
        """The group kept under `key`, now the caller's alone (None: none kept)."""
        with self._lock:
            doomed = self._idle()
            kept = self._groups.pop(key, None)
        for g in doomed:
            g.close()
        return kept[0] if kept is not None else None

    def give_back(self, key: str, group: PairGroup) -> None:
        """Keep `group` under `key` after a pull that ended well; a group already kept under
        it (a concurrent pull made a second one), the least recently used beyond the limit,
        and every group given back after `close` are closed."""
        with self._lock:
            if self._closed:
                doomed = [group]
            else:
                old = self._groups.pop(key, None)
                self._groups[key] = (group, self._clock())
                doomed = [old[0]] if old is not None else []
                while len(self._groups) > self._limit:
                    doomed.append(self._groups.popitem(last=False)[1][0])
                doomed += self._idle()
        for g in doomed:
            g.close()

    def _idle(self) -> list[PairGroup]:
        """Out of the registry: the groups unused for `idle_s` (the oldest come first)."""
        now, doomed = self._clock(), []
        while self._groups:
            key, (group, since) = next(iter(self._groups.items()))
            if now - since < self._idle_s:
                break
            del self._groups[key]
            doomed.append(group)
        return doomed

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)

    def close(self) -> None:
        """Close every kept group; a group in use is closed when it is given back."""
        with self._lock:
            self._closed = True
            doomed = [group for group, _ in self._groups.values()]
            self._groups.clear()
        for g in doomed:
            g.close()
