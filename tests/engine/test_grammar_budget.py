"""Bounded grammar work: documented size limits before anything compiles, and a time budget
that a spec's compile cannot outlast (the grammar sandbox kills its worker), without holding
up the small specs of other requests."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import wait

import psutil
import pytest

from pdmesh.engine.structured.grammar import GrammarCompiler, grammar_vocabulary
from pdmesh.engine.structured.grammar_sandbox import GrammarSandbox, SandboxVocabulary
from pdmesh.engine.structured_output import MAX_CHOICES, MAX_SPEC_BYTES, StructuredOutput

BUDGET_S = 1.0
# Optional properties are what xgrammar compiles slowest: 2,000 of them (57 KB, under the size
# limit) take tens of seconds against SmolLM2's vocabulary, far past the budget.
SLOW_SCHEMA = json.dumps({"type": "object",
                          "properties": {f"p{i}": {"type": "string"} for i in range(2000)}})


def sandbox_workers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "pdmesh.engine.structured.grammar_sandbox" in " ".join(p.cmdline())]


@pytest.mark.fast
def test_limits_are_checked_when_the_spec_is_built() -> None:
    with pytest.raises(ValueError, match=f"has {MAX_CHOICES + 1} entries; the limit is "
                                         f"{MAX_CHOICES}"):
        StructuredOutput(choice=tuple(f"c{i}" for i in range(MAX_CHOICES + 1)))
    big = json.dumps({"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(20_000)}})
    with pytest.raises(ValueError, match=rf"json_schema is {len(big)} bytes; the limit is "
                                         rf"{MAX_SPEC_BYTES} bytes"):
        StructuredOutput(json_schema=big)
    with pytest.raises(ValueError, match=r"structured_output\.grammar is"):
        StructuredOutput(grammar="root ::= " + '"a" | ' * MAX_SPEC_BYTES + '"a"')
    with pytest.raises(ValueError, match=r"choice is \d+ bytes; the limit"):
        StructuredOutput(choice=("x" * (MAX_SPEC_BYTES // 2), "y" * (MAX_SPEC_BYTES // 2 + 1)))
    with pytest.raises(ValueError, match="lone surrogate"):
        StructuredOutput(regex="a\ud800")
    StructuredOutput(choice=tuple(f"c{i}" for i in range(MAX_CHOICES)))  # at the limit: fine


@pytest.fixture(scope="module")
def compiler(hf_tokenizer) -> Iterator[GrammarCompiler]:
    vocabulary = grammar_vocabulary(hf_tokenizer, len(hf_tokenizer), [hf_tokenizer.eos_token_id])
    compiler = GrammarCompiler(vocabulary, compile_timeout_s=BUDGET_S)
    yield compiler
    compiler.close()


@pytest.mark.weights
@pytest.mark.processes
@pytest.mark.slow
def test_a_slow_spec_is_refused_within_its_budget_and_small_ones_pass_it(
        compiler: GrammarCompiler) -> None:
    compiler.compile(StructuredOutput(regex="warm"))  # a worker up: its start is not the budget
    started = time.monotonic()
    slow = compiler.prepare(StructuredOutput(json_schema=SLOW_SCHEMA))
    small = [compiler.prepare(StructuredOutput(regex=f"[0-9]{{{n}}}")) for n in range(1, 4)]
    wait(small, timeout=60)
    small_s = time.monotonic() - started
    assert all(f.done() and f.exception() is None for f in small)
    with pytest.raises(ValueError, match=r"json_schema did not compile within the 1 s budget"):
        slow.result(timeout=60)
    refused_s = time.monotonic() - started
    # A second worker may have to start for the small specs (seconds on a busy machine), but
    # they never wait for the slow one's budget to run out, nor for its compile.
    assert refused_s < BUDGET_S + 30, refused_s
    assert small_s < refused_s + 5
    # Cached as its failure: asking again costs nothing.
    again = time.monotonic()
    with pytest.raises(ValueError, match="budget"):
        compiler.compile(StructuredOutput(json_schema=SLOW_SCHEMA))
    assert time.monotonic() - again < 0.5


@pytest.mark.weights
@pytest.mark.processes
@pytest.mark.slow
def test_the_worker_of_a_slow_spec_is_killed(model_dir) -> None:
    """The CPU and memory of a runaway compile come back at once, and the sandbox goes on."""
    sandbox = GrammarSandbox(SandboxVocabulary(tokenizer_dir=str(model_dir)), BUDGET_S,
                             max_workers=1)
    others = {p.pid for p in sandbox_workers()}  # the module's compiler has its own
    try:
        sandbox.check("regex", "[a-z]+")
        (worker,) = [p for p in sandbox_workers() if p.pid not in others]
        with pytest.raises(ValueError, match="budget"):
            sandbox.check("json_schema", SLOW_SCHEMA)
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
        with pytest.raises(ValueError, match=r"regex does not compile"):
            sandbox.check("regex", "(ab")
        sandbox.check("choice", ("yes", "no"))
    finally:
        sandbox.close()
    assert {p.pid for p in sandbox_workers()} <= others
