"""The real SmolLM2 tokenizer through its Hub id, offline (HF_HUB_OFFLINE=1, HF_HOME in a tmp
cache): the router's prompt tokenizer, which needs no weights (its Hub resolution fetches
none), and an engine's, from the model or from a separate `--tokenizer`; the same token ids
as through the alias."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.tokenizing import load_tokenizer
from pdmesh.router.prompt_tokenizer import PromptTokenizer
from tests.hub_cache import SMOLLM2_ID, commit_of, model_files, put_snapshot

pytestmark = [pytest.mark.slow, pytest.mark.weights]

TEXT = "The capital of France is"


@pytest.fixture
def tokenizer_only(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """SmolLM2's Hub id in an offline cache holding its configs and tokenizer, no weights."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = {k: v for k, v in model_files(model_dir).items() if not k.endswith(".safetensors")}
    return put_snapshot(tmp_path / "hf" / "hub", SMOLLM2_ID, commit_of("smollm2"), files)


def test_the_router_tokenizes_through_a_hub_id(tokenizer_only: Path, hf_tokenizer: object
                                              ) -> None:
    router = PromptTokenizer(SMOLLM2_ID, pool_size=1)
    assert router.model_dir == tokenizer_only
    copy = router._idle.get_nowait()
    assert copy(TEXT)["input_ids"] == hf_tokenizer(TEXT)["input_ids"]  # type: ignore[operator]


def test_an_engine_takes_a_separate_tokenizer_by_hub_id(tokenizer_only: Path,
                                                        hf_tokenizer: object) -> None:
    tokenizer = load_tokenizer(EngineConfig(model="smollm2", tokenizer=SMOLLM2_ID))
    assert tokenizer(TEXT)["input_ids"] == hf_tokenizer(TEXT)["input_ids"]  # type: ignore[operator]
    assert tokenizer.name_or_path == str(tokenizer_only)
