"""The collectives' timing (engine/worker/parallel/group.py `record_collectives`), which
bench/tp_step.py turns on to tell a tensor-parallel step's communication from its compute:
off by default, every kind counted when on, and a late rank's wait inside the time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pdmesh.engine.worker.parallel import group
from pdmesh.engine.worker.parallel.group import (
    SINGLE,
    CollectiveTimes,
    TensorParallel,
    join_group,
    record_collectives,
)

pytestmark = pytest.mark.fast

Body = Callable[[TensorParallel], object]


@pytest.fixture(autouse=True)
def _recording_off_after() -> Iterator[None]:
    yield
    record_collectives(None)


def _pair(tmp_path: Path, body0: Body, body1: Body) -> list[object]:
    """`body0(tp)` and `body1(tp)` as ranks 0 and 1 of a gloo group, on two threads."""
    results: list[object] = [None, None]

    def rank(r: int, body: Body) -> None:
        tp = join_group(str(tmp_path / "store"), r, 2, torch.device("cpu"), join_timeout_s=30)
        try:
            results[r] = body(tp)
        except Exception as exc:
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r, b), name=f"rank{r}")
               for r, b in enumerate((body0, body1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank is stuck in a collective"
    return results


def _collectives(tp: TensorParallel) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One of each: what a step does (inputs broadcast, all-reduces, the logits gather)."""
    summed = tp.all_reduce(torch.full((3,), float(tp.rank + 1)))
    widths = [3, 2]  # uneven, as SmolLM2's vocabulary split can be
    gathered = tp.gather_columns(torch.full((2, widths[tp.rank]), float(tp.rank)), widths)
    sent = tp.broadcast(torch.tensor([7, 8]) if tp.is_first else torch.zeros(2, dtype=torch.long))
    return summed, gathered, sent


def test_nothing_is_recorded_by_default(tmp_path: Path) -> None:
    assert group._recording is None
    results = _pair(tmp_path, _collectives, _collectives)
    assert group._recording is None
    assert results[0][0].tolist() == [3.0, 3.0, 3.0]  # type: ignore[index]


def test_each_kind_is_counted_and_the_results_are_unchanged(tmp_path: Path) -> None:
    times = CollectiveTimes()
    assert record_collectives(times) is None
    results = _pair(tmp_path, _collectives, _collectives)
    summed, gathered, sent = results[0]  # type: ignore[misc]
    assert summed.tolist() == [3.0, 3.0, 3.0]
    assert gathered is not None
    assert gathered.tolist() == [[0.0, 0.0, 0.0, 1.0, 1.0]] * 2
    assert sent.tolist() == [7, 8]
    assert results[1][1] is None and results[1][2].tolist() == [7, 8]  # type: ignore[index]
    # both ranks run on threads of this process, so both record into the one recorder
    assert times.calls == {"all_reduce": 2, "gather": 2, "broadcast": 2}
    assert all(s >= 0 for s in times.seconds.values())
    assert times.total == pytest.approx(sum(times.seconds.values()))
    assert record_collectives(None) is times


def test_a_single_rank_records_nothing() -> None:
    times = CollectiveTimes()
    record_collectives(times)
    x = torch.ones(4)
    assert SINGLE.all_reduce(x) is x and SINGLE.broadcast(x) is x
    assert SINGLE.gather_columns(x.view(2, 2), [2]) is not None
    assert times.calls == {} and times.total == 0.0


def test_the_wait_for_a_late_rank_is_inside_the_time(tmp_path: Path) -> None:
    """Rank 1 enters the all-reduce `late` seconds after rank 0 started timing it (known from
    the recorder's clock), so rank 0's time, and so the total, is at least `late`."""
    late = 0.2
    started = threading.Event()

    def clock() -> float:
        now = time.perf_counter()
        if threading.current_thread().name == "rank0":
            started.set()  # after reading the time: rank 0's start is before rank 1's entry
        return now

    times = CollectiveTimes(clock=clock)
    record_collectives(times)

    def first(tp: TensorParallel) -> object:
        return tp.all_reduce(torch.ones(2))

    def second(tp: TensorParallel) -> object:
        assert started.wait(30)
        time.sleep(late)  # the lateness measured, not a synchronisation (the event is)
        return tp.all_reduce(torch.ones(2))

    results = _pair(tmp_path, first, second)
    assert [r.tolist() for r in results] == [[2.0, 2.0]] * 2  # type: ignore[union-attr]
    assert times.calls == {"all_reduce": 2}
    assert times.seconds["all_reduce"] >= late
