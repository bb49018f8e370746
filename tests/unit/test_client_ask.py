"""`pdmesh ask` leaves sampling to the server's defaults (the model's generation config)
unless --temperature is given; it used to send temperature 0 always."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from pdmesh.client import main as ask_main
from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.fast


class _RecordingRouter(router_pb2_grpc.RouterServicer):
    """A real gRPC Router that answers one token and keeps the requests it got."""

    def __init__(self) -> None:
        self.requests: list[router_pb2.GenerateRequest] = []

    def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[router_pb2.GenerateResponse]:
        self.requests.append(request)
        yield router_pb2.GenerateResponse(delta=common_pb2.SequenceDelta(
            index=0, token_ids=[1], text="ok",
            finish=common_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP)))
        yield router_pb2.GenerateResponse(result=router_pb2.GenerateResult())


@pytest.fixture()
def router() -> Iterator[tuple[_RecordingRouter, str]]:
    servicer = _RecordingRouter()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None).wait(timeout=10)


def test_ask_sends_no_temperature_unless_given(
    router: tuple[_RecordingRouter, str], capsys: pytest.CaptureFixture[str]
) -> None:
    servicer, address = router
    assert ask_main(["--router", address, "hello"]) == 0
    assert ask_main(["--router", address, "--temperature", "0.3", "hello"]) == 0
    assert capsys.readouterr().out == "ok\nok\n"
    default, given = (r.sampling for r in servicer.requests)
    assert not default.HasField("temperature")
    assert given.HasField("temperature") and given.temperature == pytest.approx(0.3)
