"""Server sampling defaults (engine/generation_config.py): vLLM's precedence, request > the
model's generation_config.json > the API's defaults, on the wire message the router forwards,
`--generation-config auto|vllm|PATH` and `--override-generation-config`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.generation_config import (
    GenerationDefaults,
    apply_to_proto,
    check_source,
    default_sampling_params,
    from_dict,
    load_generation_defaults,
    parse_override,
)
from pdmesh.v1 import common_pb2

pytestmark = pytest.mark.fast

MODEL_FILE = {"temperature": 0.2, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
              "max_new_tokens": 64, "bos_token_id": 1}


def write(dir_: Path, config: dict[str, object]) -> Path:
    (dir_ / "generation_config.json").write_text(json.dumps(config))
    return dir_


def test_unset_fields_take_the_model_defaults_and_set_ones_win() -> None:
    defaults = from_dict(MODEL_FILE)
    merged = apply_to_proto(common_pb2.SamplingParams(n=2), defaults)
    assert merged.temperature == pytest.approx(0.2) and merged.top_p == pytest.approx(0.9)
    assert merged.top_k == 20 and merged.max_tokens == 64 and merged.n == 2
    assert merged.repetition_penalty == pytest.approx(1.1)
    mine = common_pb2.SamplingParams(temperature=0.0, top_k=-1, max_tokens=5, top_p=1.0)
    merged = apply_to_proto(mine, defaults)
    assert (merged.temperature, merged.top_k, merged.max_tokens, merged.top_p) == (0, -1, 5, 1)
    assert not merged.HasField("seed")  # nothing invented


def test_no_defaults_leave_the_request_untouched() -> None:
    request = common_pb2.SamplingParams(n=1)
    merged = apply_to_proto(request, GenerationDefaults())
    assert merged == request and not merged.HasField("temperature")


def test_do_sample_false_means_greedy() -> None:
    assert from_dict({"do_sample": False, "temperature": 0.7}).temperature == 0.0


def test_sources(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    model = write(tmp_path / "model", MODEL_FILE)
    assert load_generation_defaults("auto", model).temperature == pytest.approx(0.2)
    assert load_generation_defaults("vllm", model) == GenerationDefaults()
    other = tmp_path / "other"
    other.mkdir()
    write(other, {"temperature": 0.0, "max_new_tokens": 5})
    assert load_generation_defaults(str(other), model).as_dict() == {"temperature": 0.0,
                                                                     "max_tokens": 5}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert load_generation_defaults("auto", empty) == GenerationDefaults()  # model ships none
    with pytest.raises(ValueError, match=r"holds no generation_config\.json"):
        check_source(str(empty))
    with pytest.raises(ValueError, match="--generation-config"):
        check_source(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig(generation_config=str(tmp_path / "nowhere"))


def test_offline_defaults_are_sampling_params() -> None:
    params = default_sampling_params(from_dict(MODEL_FILE), max_tokens=8)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (
        pytest.approx(0.2), pytest.approx(0.9), 20, 8)


def test_override_merges_over_the_source(tmp_path: Path) -> None:
    """`--override-generation-config`, as vLLM merges it: over the model's file with auto,
    alone with vllm; in the file's own names (max_new_tokens)."""
    model = write(tmp_path, MODEL_FILE)
    override = '{"temperature": 0.5, "max_new_tokens": 256}'
    merged = load_generation_defaults("auto", model, override)
    assert merged.as_dict() == {"temperature": 0.5, "top_p": pytest.approx(0.9), "top_k": 20,
                                "repetition_penalty": pytest.approx(1.1), "max_tokens": 256}
    assert load_generation_defaults("vllm", model, override).as_dict() == {
        "temperature": 0.5, "max_tokens": 256}
    assert load_generation_defaults("auto", model, {"do_sample": False}).temperature == 0.0
    assert load_generation_defaults("auto", model, "") == from_dict(MODEL_FILE)


@pytest.mark.parametrize(("override", "problem"), [
    ("{temperature: 1}", "not valid JSON"),
    ("[0.5]", "must be a JSON object"),
    ('{"top_k": "many"}', "--override-generation-config: invalid literal"),
])
def test_a_bad_override_is_refused_naming_the_flag(override: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_override(override)
    from pdmesh.router.config import RouterConfig

    with pytest.raises(ValueError, match="--override-generation-config"):
        RouterConfig(redis_url="redis://127.0.0.1:1/0", override_generation_config=override)


def test_the_offline_llm_takes_the_override_as_a_mapping() -> None:
    assert EngineConfig(override_generation_config={"temperature": 0.5})
    with pytest.raises(ValueError, match="--override-generation-config"):
        EngineConfig(override_generation_config={"top_k": "many"})
