"""The supervisor on real (tiny) child processes: a killed child comes back and its clean-up
runs; one that fails to start is retried on a growing backoff; the backoff's arithmetic."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator

import pytest

from pdmesh.serve import Child
from pdmesh.serve.supervisor import Backoff, ChildSpec, Supervised, Supervisor, exit_reason
from tests.polling import wait_for

SERVES = [sys.executable, "-c", "import time; print('ready here', flush=True); time.sleep(600)"]
FAILS = [sys.executable, "-c", "import sys; sys.exit(3)"]
FAST = Backoff(initial_s=0.01, factor=2.0, max_s=0.1, healthy_after_s=60.0)


@pytest.mark.fast
def test_backoff_grows_to_its_cap() -> None:
    backoff = Backoff(initial_s=0.5, factor=2.0, max_s=30.0)
    assert [backoff.delay_s(n) for n in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert backoff.delay_s(10_000) == 30.0


@pytest.mark.fast
def test_exit_reason_names_the_signal() -> None:
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_reason(4) == "exit code 4"


@pytest.fixture
def children() -> Iterator[list[Child]]:
    """Every child a test launched; all are gone afterwards."""
    launched: list[Child] = []
    yield launched
    for child in launched:
        child.kill()


def launcher(children: list[Child], argvs: Callable[[], list[str]]) -> Callable[[], Child]:
    def launch() -> Child:
        children.append(Child("t", argvs()))
        return children[-1]

    return launch


@pytest.mark.processes
def test_a_killed_child_comes_back_after_its_clean_up(children: list[Child]) -> None:
    exits: list[tuple[int | None, int]] = []
    launched: list[Supervised] = []
    launch = launcher(children, lambda: SERVES)
    first = launch()
    first.wait_ready(30)
    supervisor = Supervisor(poll_interval_s=0.02)
    supervisor.watch(ChildSpec("t", launch, startup_timeout_s=30, backoff=FAST,
                               on_launch=launched.append,
                               on_exit=lambda p, status: exits.append((p.pid, status))), first)
    try:
        first.kill()
        state = supervisor.state("t")
        wait_for(lambda: state.restarts == 1, "the restart")
        assert exits == [(first.pid, -signal.SIGKILL)]
        assert (state.exits, state.last_exit, state.ended) == (1, "killed by SIGKILL", first)
        assert launched == [state.process] == [children[-1]] and children[-1].running()
    finally:
        supervisor.stop()
        for child in children:
            child.kill()
        supervisor.join()
    assert len(children) == 2, "no restart after stop()"


@pytest.mark.processes
def test_a_child_failing_to_start_is_retried_on_a_growing_backoff(
    children: list[Child],
) -> None:
    exits: list[int] = []
    attempts = iter([FAILS, FAILS, FAILS, SERVES])
    launch = launcher(children, lambda: next(attempts))
    first = Child("t", SERVES)
    children.append(first)
    first.wait_ready(30)
    supervisor = Supervisor(poll_interval_s=0.02)
    supervisor.watch(ChildSpec("t", launch, startup_timeout_s=30, backoff=FAST,
                               on_exit=lambda p, status: exits.append(status)), first)
    try:
        first.kill()
        state = supervisor.state("t")
        wait_for(lambda: state.restarts == 1, "the restart after three failed starts")
        assert exits == [-signal.SIGKILL, 3, 3, 3]
        assert (state.exits, state.last_exit) == (4, "exit code 3")
        assert state.failures == 4  # reset only by a run of healthy_after_s
    finally:
        supervisor.stop()
        for child in children:
            child.kill()
        supervisor.join()
