"""Shared fixtures (the real SmolLM2 weights and the transformers reference on them), and the
rule that keeps the test tiers honest.

Every test names its tier with markers (pyproject.toml lists them), set once per module with
`pytestmark` and, where a module's tests differ, on the tests themselves:

* `fast`: runs in-process only: no child process, no Redis, no model files. `pytest -m fast`
  is the loop to run on every edit (under 2 minutes on 2 cores); keep a fast test fast.
* otherwise what the test needs: `weights` (model_dir, hf_model, hf_tokenizer, an engine on
  SmolLM2), `redis` (a redis-server), `processes` (anything started with subprocess); plus
  `slow` when it takes seconds, and `e2e` for a mesh of real services.

`pytest_runtest_setup` below fails a test that names no tier, and a `fast` test that also names
a heavier tier or asks for a fixture of one (tests/tiers.py), so the tiers stay true as tests
are added.
"""

from __future__ import annotations

import os

import pytest

from tests.tiers import tier_problem

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail a test whose markers do not say honestly what it needs (tests/tiers.py)."""
    problem = tier_problem(item.nodeid, {mark.name for mark in item.iter_markers()},
                           set(getattr(item, "fixturenames", ())))
    if problem is not None:
        pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="session")
def model_dir():
    from pdmesh.engine.model_store import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """After the whole suite (fault tests included): no service process or redis-server of
    ours still running, and no KV shared-memory segment of a dead process left in /dev/shm."""
    import psutil

    from pdmesh.kvstore.transfer.backends.base import DEFAULT_SHM_DIR
    from pdmesh.kvstore.transfer.backends.shm import PREFIX
    from pdmesh.leftovers import KV_SEGMENT

    before = {n for n in os.listdir(DEFAULT_SHM_DIR) if n.startswith(PREFIX)}
    yield
    me = psutil.Process()
    orphans = []
    for child in me.children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "pdmesh" in cmdline or "redis-server" in cmdline:
            orphans.append(f"{child.pid}: {cmdline[:120]}")
    leftover = sorted(  # a name of another shape is no segment of ours: not judged here
        n for n in os.listdir(DEFAULT_SHM_DIR)
        if n not in before and (m := KV_SEGMENT.fullmatch(n)) is not None
        and not psutil.pid_exists(int(m.group(2)))
    )
    assert not orphans, f"service processes left running after the suite: {orphans}"
    assert not leftover, f"KV shm segments of dead processes left behind: {leftover}"
