"""One engine instance as this router sees it: its address and channel, what its polls said,
and the router's own view of its load and progress.

Polled loads lag, so the router counts what it sent there itself (`request_started`,
`request_finished`: what routing takes as load before the next poll says it) and corrects the
last poll for requests that finished since it was sent. `progress_at` is the latest evidence
that the instance was making progress (a delta of any call on it, or an answered poll whose
core answered recently), which the progress watchdog (router/watchdog.py) judges it by. The
pool (router/instances.py) keeps the instances and polls them.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import grpc

from pdmesh.engine.frontend.stall import StallBound
from pdmesh.router.routing.base import Candidate, LoadSnapshot
from pdmesh.v1 import engine_pb2, engine_pb2_grpc


@dataclass
class Instance:
    """One engine process behind one address, as seen by this router."""

    address: str
    role: str  # "prefill", "decode" or "colocated" (the role it was listed or registered as)
    channel: grpc.aio.Channel
    static: bool = False
    registered: bool = False
    info: engine_pb2.EngineInfo | None = None
    load: engine_pb2.EngineLoad = field(default_factory=engine_pb2.EngineLoad)
    healthy: bool = False
    detail: str = "not polled yet"
    failures: int = 0
    inflight_requests: int = 0
    inflight_blocks: int = 0
    load_polled_at: float = 0.0  # monotonic time the poll behind `load` was sent
    recent_finishes: deque[tuple[float, float, int]] = field(
        default_factory=lambda: deque(maxlen=1024)
    )  # (started, finished, blocks) of requests that ended since the last poll was sent
    progress_at: float = field(default_factory=time.monotonic)  # latest evidence of progress
    progress_check: asyncio.Task[None] | None = None  # a confirm_progress call in flight

    def note_progress(self, at: float) -> None:
        """Evidence that the instance was making progress at `at` (monotonic)."""
        self.progress_at = max(self.progress_at, at)

    def stall_bound_s(self, bound: StallBound) -> float:
        """How long this instance may show no progress before it counts as hung: scaled by
        the longest step it reported to expect (engine/frontend/stall.py)."""
        return bound.seconds(self.load.max_step_s)

    def request_started(self, blocks: int) -> float:
        """Count a request this router sent here; returns its start time."""
        self.inflight_requests += 1
        self.inflight_blocks += blocks
        return time.monotonic()

    def request_finished(self, blocks: int, started: float) -> None:
        """Undo `request_started`, and correct the polled load, which lags: a snapshot taken
        while the request ran still counts its blocks as in use, and routing on it until the
        next poll would penalise exactly the instance whose cache the request just filled."""
        self.inflight_requests -= 1
        self.inflight_blocks -= blocks
        finished = time.monotonic()
        self.recent_finishes.append((started, finished, blocks))
        if self.load_polled_at > started:
            self._free_in_snapshot(blocks)

    def apply_poll(self, load: engine_pb2.EngineLoad, sent_at: float) -> None:
        """Take a GetLoad answer (sent at `sent_at`), re-applying the corrections for
        requests that finished after it was sent."""
        self.load = load
        self.load_polled_at = sent_at
        for started, finished, blocks in self.recent_finishes:
            if started < sent_at < finished:
                self._free_in_snapshot(blocks)
        while self.recent_finishes and self.recent_finishes[0][1] <= sent_at:
            self.recent_finishes.popleft()

    def _free_in_snapshot(self, blocks: int) -> None:
        self.load.num_free_blocks = min(
            self.load.num_total_blocks, self.load.num_free_blocks + blocks
        )
        self.load.num_running = max(0, self.load.num_running - 1)

    @property
    def instance_id(self) -> str:
        return self.info.instance_id if self.info is not None else ""

    def serves(self, role: str) -> bool:
        return self.role == role or self.role == "colocated"

    def prefill_stub(self) -> engine_pb2_grpc.PrefillStub:
        return engine_pb2_grpc.PrefillStub(self.channel)

    def decode_stub(self) -> engine_pb2_grpc.DecodeStub:
        return engine_pb2_grpc.DecodeStub(self.channel)

    def snapshot(self) -> LoadSnapshot:
        return LoadSnapshot(
            num_running=self.load.num_running,
            num_waiting=self.load.num_waiting,
            num_free_blocks=self.load.num_free_blocks,
            num_total_blocks=self.load.num_total_blocks,
            inflight_requests=self.inflight_requests,
            inflight_blocks=self.inflight_blocks,
        )

    def candidate(self, cached: dict[str, int]) -> Candidate:
        return Candidate(self.instance_id, self.snapshot(), cached.get(self.instance_id, 0))
