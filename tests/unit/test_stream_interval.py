"""engine/frontend/output_processor.py's stream interval (vLLM's `--stream-interval`): a running
request's output goes out once a sample has N tokens not handed out yet; the first output, a
sample's finish and the request's end go at once; nothing is lost in between. Driven with the
core's own output structs and the real SmolLM2 tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from pdmesh.config import parse_config
from pdmesh.decode_svc.config import DecodeConfig
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core_types import CoreOutput, SampleDelta
from pdmesh.engine.frontend.output_processor import OutputProcessor
from pdmesh.engine.outputs import RequestOutput
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine_svc.codec import SamplingError, sampling_from_proto
from pdmesh.engine_svc.config import EngineServiceConfig
from pdmesh.serve import LocalMesh, MeshConfig
from pdmesh.v1 import common_pb2

TEXT = " one two three four five six seven eight nine ten eleven twelve"


def token_ids(tokenizer: Any) -> list[int]:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 12
    return list(ids[:12])


def step(processor: OutputProcessor, request_id: str, index_tokens: dict[int, list[int]],
         finish: dict[int, str] | None = None) -> list[RequestOutput]:
    """One core step that appended `index_tokens[i]` to sample i (and ended those in
    `finish`)."""
    samples = [SampleDelta(index=i, new_token_ids=ids,
                           finish_reason=(finish or {}).get(i))
               for i, ids in index_tokens.items()]
    outputs, _ = processor.process([CoreOutput(request_id=request_id, samples=samples)])
    return outputs


@pytest.mark.weights
@pytest.mark.parametrize(("engine_interval", "request_interval", "want"), [
    (1, None, 1), (4, None, 4), (1, 4, 4), (4, 2, 4), (3, 5, 5),
])
def test_outputs_go_out_every_interval_tokens_and_at_the_end(
    hf_tokenizer: Any, engine_interval: int, request_interval: int | None, want: int
) -> None:
    processor = OutputProcessor(hf_tokenizer, {hf_tokenizer.eos_token_id}, engine_interval)
    ids = token_ids(hf_tokenizer)
    params = SamplingParams(max_tokens=len(ids), stream_interval=request_interval)
    processor.add_request("r", None, [1, 2, 3], params)
    handed: list[tuple[int, RequestOutput]] = []  # (step, output)
    for k, token in enumerate(ids):
        last = k == len(ids) - 1
        for out in step(processor, "r", {0: [token]}, {0: "length"} if last else None):
            handed.append((k + 1, out))
    # The first token at once, then every `want` tokens, then the end (12 tokens).
    expected = sorted({1, *range(1 + want, len(ids) + 1, want), len(ids)})
    assert [n for n, _ in handed] == expected
    assert [len(out.outputs[0].token_ids) for _, out in handed] == expected
    final = handed[-1][1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert final.outputs[0].token_ids == ids
    assert final.outputs[0].text == hf_tokenizer.decode(ids)
    assert "r" not in processor.requests


@pytest.mark.weights
def test_the_first_token_is_never_held(hf_tokenizer: Any) -> None:
    """An output before any token (the core reporting the queue time) does not count as the
    first: the first token still goes out at once."""
    processor = OutputProcessor(hf_tokenizer, {hf_tokenizer.eos_token_id}, stream_interval=8)
    ids = token_ids(hf_tokenizer)
    processor.add_request("r", None, [1, 2, 3], SamplingParams(max_tokens=len(ids)))
    outs, _ = processor.process([CoreOutput(request_id="r", queue_s=0.01)])
    assert [out.outputs[0].token_ids for out in outs] in ([], [[]])
    assert [out.outputs[0].token_ids for out in step(processor, "r", {0: ids[:1]})] == \
        [ids[:1]]
    assert step(processor, "r", {0: ids[1:2]}) == []


@pytest.mark.weights
def test_a_sample_that_finishes_goes_out_at_once(hf_tokenizer: Any) -> None:
    """n=2: one sample's finish is handed out at once, though the other is mid-interval."""
    processor = OutputProcessor(hf_tokenizer, {hf_tokenizer.eos_token_id}, stream_interval=8)
    ids = token_ids(hf_tokenizer)
    processor.add_request("r", None, [1, 2, 3], SamplingParams(n=2, max_tokens=len(ids)))
    assert len(step(processor, "r", {0: ids[:1], 1: ids[:1]})) == 1  # the first output
    assert step(processor, "r", {0: ids[1:3], 1: ids[1:3]}) == []  # 2 pending of 8
    outs = step(processor, "r", {0: ids[3:4], 1: ids[3:4]}, {1: "stop"})
    assert len(outs) == 1 and not outs[0].finished
    assert [c.finish_reason for c in outs[0].outputs] == [None, "stop"]
    assert [len(c.token_ids) for c in outs[0].outputs] == [4, 4]
    assert step(processor, "r", {0: ids[4:6]}) == []  # sample 0 alone, 2 pending of 8
    outs = step(processor, "r", {0: ids[6:7]}, {0: "length"})
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].token_ids == ids[:7]


@pytest.mark.weights
def test_a_stop_string_ends_the_request_at_once(hf_tokenizer: Any) -> None:
    """A stop string found mid-interval: the output goes out then, cut at the stop, and the
    core is told to stop the sample."""
    processor = OutputProcessor(hf_tokenizer, {hf_tokenizer.eos_token_id}, stream_interval=16)
    ids = token_ids(hf_tokenizer)
    processor.add_request("r", None, [1, 2, 3], SamplingParams(max_tokens=32, stop=" five"))
    handed: list[RequestOutput] = []
    stops = []
    for token in ids:
        outputs, stopped = processor.process(
            [CoreOutput(request_id="r", samples=[SampleDelta(index=0, new_token_ids=[token])])])
        handed += outputs
        stops += stopped
        if stopped:
            break
    assert stops == [("r", [0])]
    assert len(handed) == 2 and handed[-1].finished
    assert handed[-1].outputs[0].finish_reason == "stop"
    assert handed[-1].outputs[0].text == " one two three four"


@pytest.mark.fast
def test_the_interval_is_validated_where_it_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="stream_interval must be an integer >= 1"):
        SamplingParams(stream_interval=0)
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)
    with pytest.raises(SystemExit):
        parse_config(EngineServiceConfig, ["--stream-interval", "0"], prog="engine", env={})
    assert "--stream-interval must be an integer >= 1" in capsys.readouterr().err
    config = parse_config(EngineServiceConfig, [], prog="engine",
                          env={"PDMESH_STREAM_INTERVAL": "8"})
    assert config.engine.stream_interval == 8
    wire = common_pb2.SamplingParams(stream_interval=6)
    assert sampling_from_proto(wire).stream_interval == 6
    assert sampling_from_proto(common_pb2.SamplingParams()).stream_interval is None
    with pytest.raises(SamplingError, match="stream_interval"):
        sampling_from_proto(common_pb2.SamplingParams(stream_interval=0))


@pytest.mark.fast
def test_serve_hands_the_interval_to_its_engines() -> None:
    config = parse_config(MeshConfig, ["--stream-interval", "4",
                                       "--redis-url", "redis://127.0.0.1:1/0"],
                          prog="serve", env={})
    argv = LocalMesh(config, env={}).engine_args("decode")
    assert parse_config(DecodeConfig, argv, prog="decode").engine.stream_interval == 4
