"""SamplingParams: vLLM-compatible defaults, normalization, and field-naming validation."""

from __future__ import annotations

import math

import pytest

from pdmesh.engine.sampling_params import MAX_LOGPROBS, SamplingParams

pytestmark = pytest.mark.fast


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.logprobs is None and p.prompt_logprobs is None and p.seed is None
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert not p.is_greedy and not p.needs_penalties and not p.needs_logit_processing


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"n": 1.5}, "n must be an integer"),
        ({"n": True}, "n must be an integer"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"temperature": math.inf}, "temperature must be >= 0 and finite"),
        ({"temperature": math.nan}, "temperature must not be NaN"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
        ({"top_p": 1.01}, "top_p must be in (0, 1]"),
        ({"top_k": -2}, "top_k must be >= -1"),
        ({"top_k": 2.0}, "top_k must be an integer"),
        ({"min_p": -0.1}, "min_p must be in [0, 1]"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"presence_penalty": -2.01}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids >= 0"),
        ({"logit_bias": {1.5: 1.0}}, "logit_bias keys must be token ids >= 0"),
        ({"logit_bias": {3: 101.0}}, "logit_bias values must be in [-100, 100]"),
        ({"logit_bias": {3: math.nan}}, "logit_bias[3] must not be NaN"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
        ({"seed": 1.0}, "seed must be an integer"),
        ({"stop": ""}, "stop strings must be non-empty"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
        ({"stop": ["ok", 3]}, "stop strings must be non-empty strings"),
        ({"stop": 3}, "stop must be a string or a list of strings"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids must be ints >= 0"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of ints"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be a bool"),
        ({"ignore_eos": "yes"}, "ignore_eos must be a bool"),
        ({"skip_special_tokens": None}, "skip_special_tokens must be a bool"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": 2.0}, "max_tokens must be an integer"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be <= max_tokens (4), got 5"),
        ({"logprobs": -1}, f"logprobs must be in [0, {MAX_LOGPROBS}]"),
        ({"logprobs": MAX_LOGPROBS + 1}, f"logprobs must be in [0, {MAX_LOGPROBS}]"),
        ({"prompt_logprobs": -1}, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"),
        ({"prompt_logprobs": 100}, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert message in str(excinfo.value)


def test_boundary_values_are_accepted() -> None:
    p = SamplingParams(
        temperature=0,
        top_p=1,
        top_k=-1,
        min_p=1.0,
        repetition_penalty=0.5,
        presence_penalty=-2,
        frequency_penalty=2,
        logit_bias={0: -100, 1: 100},
        min_tokens=16,
        max_tokens=16,
        logprobs=0,
        prompt_logprobs=MAX_LOGPROBS,
        seed=-3,
    )
    assert isinstance(p.temperature, float) and p.is_greedy
    assert isinstance(p.top_p, float) and isinstance(p.presence_penalty, float)
    assert not p.uses_top_k


def test_min_tokens_is_unbounded_without_max_tokens() -> None:
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000


def test_greedy_with_several_samples_is_allowed() -> None:
    p = SamplingParams(n=4, temperature=0.0)
    assert p.is_greedy and p.n == 4


def test_stop_and_stop_token_ids_are_normalized_to_lists() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(7, 8)).stop_token_ids == [7, 8]
    assert SamplingParams(stop="x").stop_strings == ["x"]


def test_logit_bias_accepts_json_string_keys() -> None:
    p = SamplingParams(logit_bias={"50": -100, 7: 2})
    assert p.logit_bias == {50: -100.0, 7: 2.0}
    assert p.needs_logit_processing and not p.needs_penalties


def test_greedy_threshold_and_feature_flags() -> None:
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(top_k=5).uses_top_k
    assert SamplingParams(top_p=0.9).uses_top_p
    assert SamplingParams(min_p=0.05).uses_min_p
    for kwargs in (
        {"repetition_penalty": 1.1},
        {"presence_penalty": 0.1},
        {"frequency_penalty": -1},
    ):
        assert SamplingParams(**kwargs).needs_penalties


def test_verify_vocab_rejects_out_of_range_ids() -> None:
    SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[9]).verify_vocab(10)
    with pytest.raises(ValueError, match="logit_bias token id 10"):
        SamplingParams(logit_bias={10: 1.0}).verify_vocab(10)
    with pytest.raises(ValueError, match="stop_token_ids entry 12"):
        SamplingParams(stop_token_ids=[12]).verify_vocab(10)


def test_clone_is_deep() -> None:
    original = SamplingParams(stop=["a"], stop_token_ids=[1], logit_bias={1: 1.0}, seed=3)
    copy = original.clone()
    assert copy == original and copy is not original
    copy.stop_strings.append("b")
    copy.stop_token_ids.append(2)  # type: ignore[union-attr]
    copy.logit_bias[2] = 2.0  # type: ignore[index]
    assert original.stop == ["a"] and original.stop_token_ids == [1]
    assert original.logit_bias == {1: 1.0}
