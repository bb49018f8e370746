"""Where an in-flight step's sampled ids land on the host (async scheduling).

On CUDA the ids land in pinned buffers that a small ring reuses, each with one blocking event
made once (issue 24, item 13: a pinned buffer and a spinning event were allocated every step).
The ring's bookkeeping is plain Python and runs here on CPU buffers; a CUDA test lands many
steps through it. The CPU path (the ids are already on the host) is unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduling.sequence import Sequence
from pdmesh.engine.worker.in_flight import InFlightStep, LandingSlots

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[2]


def _seqs(n: int) -> list[Sequence]:
    return [Sequence(f"s{i}", f"r{i}", 0, [1, 2], 2, SamplingParams()) for i in range(n)]


def test_a_slot_is_reused_only_once_its_step_gave_it_back() -> None:
    ring = LandingSlots(pinned=False, size=2, capacity=4)
    a = ring.take(3)
    b = ring.take(3)
    assert a is not b and a.busy and b.busy
    c = ring.take(3)  # both held: the ring grows rather than hand out a held slot
    assert c not in (a, b) and len(ring.slots) == 3
    a.busy = False
    assert ring.take(2) is a  # the next free one in ring order
    b.busy = c.busy = False
    assert ring.take(1) is b and ring.take(1) is c


def test_a_step_wider_than_its_slot_gets_a_wider_buffer() -> None:
    ring = LandingSlots(pinned=False, size=1, capacity=4)
    slot = ring.take(4)
    assert slot.host.numel() == 4
    slot.busy = False
    slot = ring.take(9)
    assert slot.host.numel() >= 9 and ring.capacity >= 9
    assert slot.ready is None  # no events off CUDA


def test_the_cpu_path_lands_the_ids_it_was_given() -> None:
    seqs = _seqs(3)
    ids = torch.tensor([7, 8, 9])
    step = InFlightStep.launch(seqs, ids)
    assert step.host is ids and step.slot is None and step.ready is None
    assert [s.num_pending for s in seqs] == [1, 1, 1]
    assert step.pending().row_of == {"s0": 0, "s1": 1, "s2": 2}
    assert step.land() == list(zip(seqs, [7, 8, 9], strict=True))
    assert [s.num_pending for s in seqs] == [0, 0, 0]


def test_every_cuda_event_of_the_runner_is_blocking() -> None:
    for path in sorted((REPO / "engine").rglob("*.py")) + sorted((REPO / "kernels").glob("*.py")):
        name, source = path.name, path.read_text()
        for call in re.findall(r"torch\.cuda\.Event\([^)]*\)", source):
            assert "blocking=True" in call, f"{name}: {call} spins the host while it waits"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_steps_land_through_the_same_pinned_buffers() -> None:
    from pdmesh.engine.worker import in_flight

    cuda = torch.device("cuda", torch.cuda.current_device())
    seqs = _seqs(5)
    InFlightStep.launch(seqs, torch.zeros(5, dtype=torch.int64, device=cuda)).land()
    ring = in_flight._RINGS[cuda]
    size = len(ring.slots)
    previous: InFlightStep | None = None
    buffers: set[int] = set()
    for step_no in range(50):
        ids = torch.arange(step_no, step_no + 5, device=cuda) * 3
        step = InFlightStep.launch(seqs, ids)
        assert step.slot is not None and step.host.is_pinned()
        buffers.add(step.host.data_ptr())
        if previous is not None:  # as the core does: launch N+1, then land N
            assert [tok for _, tok in previous.land()] == [3 * (step_no - 1 + i)
                                                          for i in range(5)]
        previous = step
    assert previous is not None
    assert [tok for _, tok in previous.land()] == [3 * (49 + i) for i in range(5)]
    assert len(ring.slots) == size and len(buffers) <= size  # two in flight: it never grew
    dropped = InFlightStep.launch(seqs, torch.zeros(5, dtype=torch.int64, device=cuda))
    dropped.drop()
    assert not any(slot.busy for slot in ring.slots)
