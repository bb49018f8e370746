"""Every service process runs on uvloop when it is installed (the default install has it), and
on asyncio's own loop when asked; either way `run_service` runs the service to its exit code."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from pdmesh.logs import event_loop_factory, run_service

pytestmark = pytest.mark.fast


def test_services_run_on_uvloop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDMESH_EVENT_LOOP", raising=False)
    assert event_loop_factory() is uvloop.new_event_loop


def test_the_standard_loop_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDMESH_EVENT_LOOP", "asyncio")
    assert event_loop_factory() is None


@pytest.mark.parametrize("loop", ["", "asyncio"])
def test_run_service_returns_the_services_exit_code(monkeypatch: pytest.MonkeyPatch,
                                                    loop: str) -> None:
    monkeypatch.setenv("PDMESH_EVENT_LOOP", loop)
    seen: list[str] = []

    async def serve() -> int:
        seen.append(type(asyncio.get_running_loop()).__module__)
        return 3

    assert run_service("test", "warning", serve) == 3
    assert seen == (["asyncio.unix_events"] if loop else ["uvloop"])
