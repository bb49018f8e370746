"""A grammar that starts after a reasoning model's thinking (`StructuredOutput.reasoning_end`):
its matcher allows every token until the output has produced the end text, whether that text is
one token, spread over several, or inside a token with more after it, and only then walks the
grammar. On a small raw vocabulary, with xgrammar's own matchers."""

from __future__ import annotations

import pytest

from pdmesh.engine.structured.grammar import GrammarMatcher

pytestmark = pytest.mark.fast

VOCAB = ["{", "}", "a", "</", "think", ">", "</think>\n", "x", "<eos>"]
LBRACE, RBRACE, A, OPEN, THINK, GT, WHOLE_TAG, X, EOS = range(len(VOCAB))


class Grammars:
    """Matchers for `\\{a*\\}` over VOCAB, compiled by xgrammar as the engine's compiler
    does (without its sandbox: nothing here could run long)."""

    def __init__(self) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, stop_token_ids=[EOS])
        self.compiled = xgr.GrammarCompiler(info).compile_regex(r"\{a*\}")
        self.token_bytes = [bytes(t) for t in info.decoded_vocab]

    def matcher(self, reasoning_end: str = "") -> GrammarMatcher:
        return GrammarMatcher(self.compiled, reasoning_end.encode(), self.token_bytes)


@pytest.fixture(scope="module", name="grammars")
def grammars_fixture() -> Grammars:
    return Grammars()


def allowed(matcher: GrammarMatcher) -> set[int]:
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, len(VOCAB))
    bitmask.fill_(0)
    matcher.fill(bitmask, 0)
    bits = int(bitmask[0, 0].item()) & ((1 << len(VOCAB)) - 1)
    return {i for i in range(len(VOCAB)) if bits >> i & 1}


@pytest.mark.parametrize("thinking", [
    [A, X, OPEN, THINK, GT],  # the tag over three tokens
    [A, WHOLE_TAG],  # the tag inside one token, a newline after it
    [OPEN, A, OPEN, THINK, GT],  # a false start first
])
def test_the_grammar_starts_after_the_end_text(grammars: Grammars, thinking: list[int]) -> None:
    matcher = grammars.matcher("</think>")
    for token in thinking:
        assert not matcher.started
        assert allowed(matcher) == set(range(len(VOCAB)))
        assert matcher.accept(token)  # free: even what the grammar forbids
        assert not matcher.is_terminated
    assert matcher.started
    assert allowed(matcher) == {LBRACE}
    assert not matcher.accept(X)  # now the grammar decides
    for token in (LBRACE, A, RBRACE, EOS):
        assert matcher.accept(token)
    assert matcher.is_terminated


def test_without_the_end_text_the_grammar_holds_from_the_first_token(
        grammars: Grammars) -> None:
    matcher = grammars.matcher()
    assert matcher.started and allowed(matcher) == {LBRACE}
    gated = grammars.matcher("</think>")
    for token in (A, OPEN, THINK, X, GT):  # "</think" then "x>": never the whole tag
        gated.accept(token)
    assert not gated.started
    assert allowed(gated) == set(range(len(VOCAB)))
