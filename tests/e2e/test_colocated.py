"""`pdmesh serve --colocated`: one engine does prefill and decode behind the same router and
gateway, for long prompts too (the router learns the engine's role and never wants a prefill
instance), with the same greedy output as the offline engine."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pdmesh import LLM, SamplingParams
from pdmesh.serve import LocalMesh, MeshConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

LONG_PROMPT = "The river runs past the mill and under the old stone bridge. " * 40


@pytest.fixture(scope="module")
def mesh() -> Iterator[LocalMesh]:
    config = MeshConfig(colocated=True, gateway_port=0, kv_cache_memory="128MiB")
    with LocalMesh(config) as local:
        yield local


def test_long_prompt_is_served_by_the_colocated_engine(mesh: LocalMesh) -> None:
    body = {"model": "smollm2", "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}
    assert mesh.gateway_url is not None
    resp = httpx.post(f"{mesh.gateway_url}/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    text = resp.json()["choices"][0]["text"]
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] > 256  # above the default local-prefill threshold

    llm = LLM("smollm2", kv_cache_memory="64MiB")
    expected = llm.generate(LONG_PROMPT, SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(expected.prompt_token_ids) == usage["prompt_tokens"]
    assert text == expected.outputs[0].text
