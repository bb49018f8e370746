"""A token whose text is held back (half of a UTF-8 character, a possible stop string) still
gets its stream chunk, with empty text, as vLLM streams it. Skipping it made a client that
times chunks (vLLM's `bench serve`) see one gap of two tokens' length: a stream of two-token
characters showed every gap doubled."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pdmesh.gateway.app import create_app
from pdmesh.gateway.config import GatewayConfig
from pdmesh.v1 import common_pb2, router_pb2

pytestmark = pytest.mark.fast


def _delta(token: int, text: str, finish: int | None = None) -> router_pb2.GenerateResponse:
    delta = common_pb2.SequenceDelta(index=0, token_ids=[token], text=text)
    if finish is not None:
        delta.finish.CopyFrom(common_pb2.Finish(reason=finish))
    return router_pb2.GenerateResponse(delta=delta)


SCRIPT = [_delta(7, "Hé"), _delta(8, ""), _delta(9, "llo", common_pb2.FINISH_REASON_STOP),
          router_pb2.GenerateResponse(result=router_pb2.GenerateResult(
              usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=3)))]


class _Call:
    async def __aiter__(self) -> AsyncIterator[router_pb2.GenerateResponse]:
        for message in SCRIPT:
            yield message

    def close(self) -> None:
        pass


class _Router:
    def generate(self, request: router_pb2.GenerateRequest,
                 metadata: tuple[tuple[str, str], ...] = ()) -> _Call:
        return _Call()

    async def list_models(self) -> list[router_pb2.ModelInfo]:
        return [router_pb2.ModelInfo(id="m")]


@pytest.fixture(name="http")
def http_fixture() -> Iterator[TestClient]:
    with TestClient(create_app(GatewayConfig(), client=_Router())) as http:  # type: ignore[arg-type]
        yield http


def _events(http: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    resp = http.post(path, json={"model": "m", "stream": True, **body})
    assert resp.status_code == 200, resp.text
    data = [line.removeprefix("data: ") for line in resp.text.splitlines()
            if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_a_completion_streams_a_chunk_per_token_with_empty_text_where_held_back(
        http: TestClient) -> None:
    events = _events(http, "/v1/completions", {"prompt": "x"})
    assert [e["choices"][0]["text"] for e in events] == ["Hé", "", "llo"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_chat_stream_sends_empty_content_for_a_held_back_token(http: TestClient) -> None:
    events = _events(http, "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "x"}]})
    contents = [e["choices"][0]["delta"].get("content") for e in events if e["choices"]]
    assert contents[-3:] == ["Hé", "", "llo"]
