"""`--sse-keep-alive-interval`: a stream that has been idle that long gets an SSE comment, the
next event still arrives whole and in order, and closing the stream closes what it wraps; the
gateway asks the router to say when it accepted a streamed request and starts the answer then,
the acceptance itself sending nothing of its own (chat and /v1/responses alike)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator

import pytest
from fastapi.testclient import TestClient

from pdmesh.gateway.app import create_app
from pdmesh.gateway.config import GatewayConfig
from pdmesh.gateway.streaming import KEEP_ALIVE, with_keep_alive
from pdmesh.v1 import common_pb2, router_pb2
from tests.unit.test_gateway_responses import STOPPED, StandInRouter

pytestmark = pytest.mark.fast


class Idle:
    """Yields "a", waits until released, yields "b"; notes whether it was closed."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.closed = False

    async def events(self) -> AsyncIterator[str]:
        try:
            yield "a"
            await self.release.wait()
            yield "b"
        finally:
            self.closed = True


def test_an_idle_stream_gets_comments_and_then_its_next_event() -> None:
    async def run() -> list[str]:
        source = Idle()
        stream = with_keep_alive(source.events(), interval_s=0.01)
        seen = [await anext(stream), await anext(stream)]  # "a", then idle: a comment
        source.release.set()
        seen += [event async for event in stream]
        assert source.closed
        return seen

    seen = asyncio.run(run())
    assert seen[:2] == ["a", KEEP_ALIVE]
    assert seen[-1] == "b" and set(seen[2:-1]) <= {KEEP_ALIVE}


def test_closing_the_stream_while_it_waits_closes_what_it_wraps() -> None:
    async def run() -> bool:
        source = Idle()
        stream = with_keep_alive(source.events(), interval_s=0.01)
        assert await anext(stream) == "a"
        assert await anext(stream) == KEEP_ALIVE
        await stream.aclose()  # the client went away while the request waited
        return source.closed

    assert asyncio.run(run())


ACCEPTED = router_pb2.GenerateResponse(accepted=router_pb2.Accepted())
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture(name="router")
def router_fixture() -> StandInRouter:
    return StandInRouter()


def _gateway(router: StandInRouter, **config: object) -> Iterator[TestClient]:
    with TestClient(create_app(GatewayConfig(**config),  # type: ignore[arg-type]
                               client=router)) as http:  # type: ignore[arg-type]
        yield http


def _data(body: str) -> list[str]:
    """The `data:` lines, with the ids and times that differ between two requests masked."""
    lines = [line for line in body.splitlines() if line.startswith("data: ")]
    return [re.sub(r'"(created|created_at)":\d+', "TIME", re.sub(r"[0-9a-f]{32}", "ID", line))
            for line in lines]


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/responses", {"model": "m", "input": "hi", "stream": True}),
])
def test_the_gateway_asks_for_acceptance_only_with_keep_alive(
        router: StandInRouter, route: str, body: dict[str, object]) -> None:
    plain = next(_gateway(router))
    before = plain.post(route, json=body).text
    assert not router.requests[-1].send_accepted
    keeping = next(_gateway(router, sse_keep_alive_interval=30.0))
    router.script = [ACCEPTED, *STOPPED]
    after = keeping.post(route, json=body).text
    assert router.requests[-1].send_accepted
    assert _data(after) == _data(before)
    whole = keeping.post(route, json={**body, "stream": False})
    assert whole.status_code == 200 and not router.requests[-1].send_accepted


def test_the_interval_is_checked_and_reaches_the_gateway() -> None:
    from pdmesh.config import parse_config
    from pdmesh.gateway.config import GatewayConfig as Gateway
    from pdmesh.serve import MeshConfig
    from pdmesh.serve.child_config import child_config, gateway_placement

    for bad in (-1.0, float("nan"), 3601.0):
        with pytest.raises(ValueError, match="--sse-keep-alive-interval must be in"):
            Gateway(sse_keep_alive_interval=bad)
    mesh = parse_config(MeshConfig, ["--model", "smollm2", "--sse-keep-alive-interval", "15"],
                        prog="serve", env={})
    gateway = child_config(Gateway, mesh, gateway_placement(
        mesh, router_address="127.0.0.1:1", port=0))
    assert gateway.sse_keep_alive_interval == 15.0


def test_a_failure_after_acceptance_is_an_error_event(router: StandInRouter) -> None:
    keeping = next(_gateway(router, sse_keep_alive_interval=30.0))
    delta = common_pb2.SequenceDelta(index=0, token_ids=[7], text="x")
    delta.finish.CopyFrom(common_pb2.Finish(reason=common_pb2.FINISH_REASON_ERROR,
                                            message="engine failed"))
    router.script = [ACCEPTED, router_pb2.GenerateResponse(delta=delta)]
    answer = keeping.post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 200
    assert any('"error":' in line for line in _data(answer.text))
