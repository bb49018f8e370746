"""The one stop rule (engine/core/stopping.py): the engine's per-token check and the prefill
instance's first-token check are the same function, so they cannot disagree."""

from __future__ import annotations

import pytest

from pdmesh.engine.core.stopping import check_stop, first_token_finish
from pdmesh.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.fast

EOS = {2}


@pytest.mark.parametrize(
    ("token", "params", "prompt_len", "max_model_len", "expected"),
    [
        (2, SamplingParams(), 5, 100, ("stop", None)),  # EOS
        (2, SamplingParams(ignore_eos=True), 5, 100, None),
        (2, SamplingParams(min_tokens=1), 5, 100, None),  # stops banned until min_tokens
        (7, SamplingParams(stop_token_ids=[7]), 5, 100, ("stop", 7)),
        (7, SamplingParams(stop_token_ids=[7], min_tokens=1), 5, 100, None),
        (9, SamplingParams(max_tokens=1), 5, 100, ("length", None)),
        (9, SamplingParams(max_tokens=2), 5, 100, None),
        (9, SamplingParams(), 99, 100, ("length", None)),  # the context is full
        (9, SamplingParams(), 98, 100, None),
    ],
)
def test_first_token_is_the_engine_rule_at_one_output_token(
    token: int, params: SamplingParams, prompt_len: int, max_model_len: int,
    expected: tuple[str, int | None] | None,
) -> None:
    assert first_token_finish(token, prompt_len, params, EOS, max_model_len) == expected
    assert check_stop(token, num_output_tokens=1, num_tokens=prompt_len + 1, params=params,
                      eos_token_ids=EOS, max_model_len=max_model_len) == expected


def test_stop_strings_and_later_tokens() -> None:
    params = SamplingParams(stop=["end"], max_tokens=3, min_tokens=1)
    common = {"params": params, "eos_token_ids": EOS, "max_model_len": 100}
    assert check_stop(5, num_output_tokens=1, num_tokens=6, stop_str="end", **common) is None
    assert check_stop(5, num_output_tokens=2, num_tokens=7, stop_str="end",
                      **common) == ("stop", "end")
    assert check_stop(5, num_output_tokens=3, num_tokens=8, **common) == ("length", None)
