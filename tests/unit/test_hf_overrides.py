"""`--hf-overrides`: the JSON object is checked where the engine's config is built, merged over
config.json by one rule (a key replaced, a `_config` sub-config updated), and read as the
engine reads any config: plainly when it can be, by transformers when it must interpret it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from pdmesh.engine.core.startup import model_max_positions
from pdmesh.engine.hf_overrides import apply_hf_overrides, parse_hf_overrides
from pdmesh.engine.worker.hf_config import load_hf_config
from pdmesh.engine.worker.models.architecture import rope_inv_freq
from tests.unit.test_checkpoint_mapping import write_config

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(("value", "expected"), [
    ("", {}), (None, {}), ("  ", {}),
    ('{"max_position_embeddings": 4096}', {"max_position_embeddings": 4096}),
    ({"sliding_window": None}, {"sliding_window": None}),
])
def test_parse(value: object, expected: dict) -> None:
    assert parse_hf_overrides(value) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "error"), [
    ("{", "--hf-overrides: not valid JSON"),
    ("[1]", "--hf-overrides must be a JSON object"),
    ('{"model_type": "gemma"}', "cannot set model_type"),
    ('{"": 1}', "keys must be non-empty strings"),
    ('{"a": "' + "x" * 70_000 + '"}', "at most 65536 bytes"),
])
def test_refusals_name_the_flag(value: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_hf_overrides(value)


def test_a_key_is_replaced_and_a_sub_config_updated() -> None:
    config = {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "beta_fast": 32},
              "text_config": {"hidden_size": 8, "vocab_size": 10}, "vocab_size": 10}
    merged = apply_hf_overrides(config, {"rope_scaling": {"rope_type": "linear", "factor": 4.0},
                                         "text_config": {"hidden_size": 16}, "new_key": 1})
    assert merged["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert merged["text_config"] == {"hidden_size": 16, "vocab_size": 10}
    assert merged["new_key"] == 1 and config["text_config"]["hidden_size"] == 8


def test_overrides_are_read_as_config_json_would_be(tmp_path: Path) -> None:
    model_dir = write_config(tmp_path / "m")
    plain = load_hf_config(model_dir, {"max_position_embeddings": 96})
    assert isinstance(plain, SimpleNamespace) and plain.max_position_embeddings == 96
    assert model_max_positions(model_dir, None, {"max_position_embeddings": 96}) == 96
    scaled = load_hf_config(model_dir, {"rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    assert not isinstance(scaled, SimpleNamespace)  # transformers interprets a scaled RoPE
    base, _ = rope_inv_freq(load_hf_config(model_dir), 8)
    linear, _ = rope_inv_freq(scaled, 8)
    assert linear.tolist() == pytest.approx((base / 4).tolist())
