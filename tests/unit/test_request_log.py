"""vLLM's --enable-log-requests / --enable-log-outputs / --max-log-len (router/request_log.py):
a line per admitted request, a line per finished sequence, texts and ids cut."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from pdmesh.router.config import RouterConfig
from pdmesh.router.request_log import LOGGER, RequestLog
from pdmesh.v1 import common_pb2, router_pb2

pytestmark = pytest.mark.fast


def delta(index: int, text: str, ids: list[int],
          reason: int | None = None) -> router_pb2.GenerateResponse:
    d = common_pb2.SequenceDelta(index=index, text=text, token_ids=ids)
    if reason is not None:
        d.finish.reason = reason
    return router_pb2.GenerateResponse(delta=d)


def test_nothing_is_logged_unless_asked() -> None:
    assert RequestLog.from_flags(False, False, None) is None
    assert RequestLog.from_flags(True, False, None).output("r") is None  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="--enable-log-outputs needs --enable-log-requests"):
        RouterConfig(redis_url="redis://127.0.0.1:1/0", enable_log_outputs=True)
    with pytest.raises(ValueError, match="--max-log-len must be >= 0"):
        RouterConfig(redis_url="redis://127.0.0.1:1/0", max_log_len=-1)


@pytest.fixture(name="quiet_process")
def quiet_process_fixture() -> Iterator[None]:
    """A process logging at WARNING, as pdmesh's do by default; levels restored after."""
    root, ours = logging.getLogger(), LOGGER.level
    before = root.level
    root.setLevel(logging.WARNING)
    LOGGER.setLevel(logging.NOTSET)
    yield
    root.setLevel(before)
    LOGGER.setLevel(ours)


@pytest.mark.usefixtures("quiet_process")
def test_request_and_output_lines(caplog: pytest.LogCaptureFixture) -> None:
    log = RequestLog.from_flags(True, True, 5)
    assert log is not None and LOGGER.isEnabledFor(logging.INFO)
    sampling = common_pb2.SamplingParams(temperature=0.5, max_tokens=3)
    with caplog.at_level(logging.DEBUG, logger=LOGGER.name):
        log.received("req-1", list(range(8)), 3, sampling)
        output = log.output("req-1")
        assert output is not None
        for message in (delta(0, "Hello", [1, 2]), delta(1, "Hi", [3]),
                        delta(0, " world", [4], common_pb2.FINISH_REASON_LENGTH),
                        delta(1, "", [5], common_pb2.FINISH_REASON_STOP),
                        router_pb2.GenerateResponse(result=router_pb2.GenerateResult())):
            output.saw(message)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == ("received request_id=req-1 prompt_tokens=8 max_tokens=3 "
                        "params={temperature: 0.5 max_tokens: 3}")
    assert lines[1] == "prompt request_id=req-1 prompt_token_ids=[0, 1, 2, 3, 4]..."
    assert lines[2:] == [
        "finished request_id=req-1 index=0 finish_reason=length output_tokens=3 "
        "output='Hello...'",
        "finished request_id=req-1 index=1 finish_reason=stop output_tokens=2 output='Hi'"]
    assert not output.texts  # nothing kept past a sequence's end
