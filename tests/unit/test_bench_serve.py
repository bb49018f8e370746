"""`pdmesh bench serve`: the metric math on crafted timings, and the dataset generators."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from pdmesh import bench_serve as bs
from pdmesh.bench_serve import RequestResult
from pdmesh.slo import parse_goodput


def _result(ttft: float, latency: float, out: int, itl: list[float], prompt: int = 10,
            ok: bool = True) -> RequestResult:
    return RequestResult(ok=ok, prompt_len=prompt, output_len=out, ttft_s=ttft,
                         latency_s=latency, itl_s=itl)


@pytest.mark.fast
def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    assert bs.tpot_s(_result(0.2, 1.2, 11, [])) == pytest.approx(0.1)
    assert bs.tpot_s(_result(0.2, 0.2, 1, [])) is None  # one token: no TPOT


@pytest.mark.fast
def test_compute_metrics_on_crafted_timings() -> None:
    results = [
        _result(0.100, 1.100, 11, [0.1] * 10, prompt=20),   # tpot 100 ms
        _result(0.300, 0.800, 6, [0.05, 0.15, 0.1, 0.1, 0.1], prompt=30),  # tpot 100 ms
        _result(0.500, 0.500, 1, [], prompt=5),             # no tpot
        _result(0.0, 0.0, 0, [], ok=False),
    ]
    m = bs.compute_metrics(results, duration_s=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (55, 18)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(9.0)
    assert m.total_token_throughput == pytest.approx(36.5)
    assert m.ttft_ms.mean == pytest.approx(300.0)
    assert m.ttft_ms.median == pytest.approx(300.0)
    assert m.tpot_ms.mean == pytest.approx(100.0)
    itls = [100.0] * 10 + [50.0, 150.0, 100.0, 100.0, 100.0]
    assert m.itl_ms.mean == pytest.approx(np.mean(itls))
    assert m.itl_ms.p99 == pytest.approx(np.percentile(itls, 99))
    assert m.e2el_ms.p90 == pytest.approx(np.percentile([1100.0, 800.0, 500.0], 90))
    assert m.goodput is None


@pytest.mark.fast
def test_percentiles_follow_linear_interpolation() -> None:
    s = bs.Stats.of(list(range(1, 101)))  # 1..100
    assert (s.mean, s.median) == (pytest.approx(50.5), pytest.approx(50.5))
    assert s.p90 == pytest.approx(90.1)
    assert s.p99 == pytest.approx(99.01)
    assert bs.Stats.of([]) == bs.Stats(0.0, 0.0, 0.0, 0.0)


@pytest.mark.fast
def test_goodput_counts_requests_meeting_every_slo() -> None:
    results = [
        _result(0.100, 1.100, 11, []),   # ttft 100, tpot 100, e2e 1100
        _result(0.600, 1.100, 6, []),    # ttft 600 (too slow)
        _result(0.100, 3.100, 11, []),   # tpot 300 (too slow)
        _result(0.200, 0.200, 1, []),    # one token: tpot does not apply
    ]
    slos = parse_goodput(["ttft:500", "tpot:150"])
    assert slos == {"ttft": 500.0, "tpot": 150.0}
    m = bs.compute_metrics(results, duration_s=4.0, slos=slos)
    assert m.goodput == pytest.approx(2 / 4.0)
    e2e = bs.compute_metrics(results, 4.0, parse_goodput(["e2el:1000"]))
    assert e2e.goodput == pytest.approx(1 / 4.0)
    freezes = [_result(0.1, 1.1, 11, [0.1] * 10), _result(0.1, 1.1, 11, [0.05] * 9 + [0.55])]
    itl = bs.compute_metrics(freezes, 2.0, parse_goodput(["itl:200"]))
    assert itl.goodput == pytest.approx(1 / 2.0)  # same tpot, one freeze of 550 ms


@pytest.mark.fast
@pytest.mark.parametrize("spec", ["ttft", "latency:5", "ttft:abc", "tpot:0"])
def test_bad_goodput_specs(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_goodput([spec])


@pytest.mark.fast
def test_sse_parsing() -> None:
    assert bs.parse_sse_line("") is None
    assert bs.parse_sse_line("data: [DONE]") is None
    assert bs.parse_sse_line(": keepalive") is None
    chunk = bs.parse_sse_line('data: {"choices":[{"index":0,"text":"ab"}]}')
    assert chunk is not None and bs.chunk_text(chunk) == "ab"
    chat = {"choices": [{"index": 0, "delta": {"content": "x"}}, {"index": 1, "delta": {}}]}
    assert bs.chunk_text(chat) == "x"
    assert bs.chunk_text({"choices": [], "usage": {"prompt_tokens": 1}}) == ""


@pytest.mark.weights
def test_random_dataset_lengths_and_seed(hf_tokenizer: Any) -> None:
    def make(seed: int) -> list[bs.Session]:
        source = bs.PromptSource(random.Random(seed), hf_tokenizer)
        return bs.random_dataset(source, 50, input_len=100, output_len=20, range_ratio=0.5)

    sessions = make(1)
    assert len(sessions) == 50 and all(len(s.turns) == 1 for s in sessions)
    for s in sessions:
        turn = s.turns[0]
        assert 50 <= turn.prompt.length <= 150 and 10 <= turn.output_len <= 30
        ids = turn.prompt.token_ids
        assert ids is not None and len(ids) == turn.prompt.length
        assert not set(ids) & set(hf_tokenizer.all_special_ids)  # never special tokens
        assert all(0 <= i < len(hf_tokenizer) for i in ids)
    lengths = {s.turns[0].prompt.length for s in sessions}
    assert len(lengths) > 10  # the range is really used
    assert [s.turns[0].prompt.token_ids for s in make(1)] == [
        s.turns[0].prompt.token_ids for s in sessions]
    assert [s.turns[0].prompt.token_ids for s in make(2)] != [
        s.turns[0].prompt.token_ids for s in sessions]


@pytest.mark.fast
def test_random_words_without_a_tokenizer() -> None:
    sessions = bs.random_dataset(bs.PromptSource(random.Random(0)), 3, 12, 4)
    for s in sessions:
        piece = s.turns[0].prompt
        assert piece.token_ids is None and len(piece.text.split()) == 12 == piece.length


@pytest.mark.weights
def test_shared_prefix_groups_share_exactly_their_prefix(hf_tokenizer: Any) -> None:
    source = bs.PromptSource(random.Random(0), hf_tokenizer)
    sessions = bs.shared_prefix_dataset(source, 10, num_groups=3, prefix_len=40, suffix_len=8,
                                        output_len=5)
    assert [s.group for s in sessions] == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    ids = [s.turns[0].prompt.token_ids for s in sessions]
    assert all(i is not None and len(i) == 48 for i in ids)
    assert ids[0][:40] == ids[3][:40] == ids[9][:40]
    assert ids[0][:40] != ids[1][:40]
    assert ids[0][40:] != ids[3][40:]  # suffixes are per request


@pytest.mark.fast
def test_multi_turn_sessions_count_turns_not_conversations() -> None:
    source = bs.PromptSource(random.Random(0))
    sessions = bs.multi_turn_dataset(source, 10, turns=4, turn_len=6, output_len=3)
    assert [len(s.turns) for s in sessions] == [4, 4, 2]


@pytest.mark.fast
def test_later_turns_carry_the_conversation_so_far() -> None:
    turn = bs.Turn(bs.Piece("next", None, 1), output_len=3)
    history = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    chat = bs._body("/v1/chat/completions", "m", history, turn, 0.0)
    assert chat["messages"][-1] == {"role": "user", "content": "next"}
    assert chat["messages"][:2] == history
    completion = bs._body("/v1/completions", "m", history, turn, 0.0)
    assert completion["prompt"] == "q1a1next"
    first = bs._body("/v1/completions", "m", [], bs.Turn(bs.Piece("t", [5, 6], 2), 3), 0.0)
    assert first["prompt"] == [5, 6] and first["max_tokens"] == 3 and first["ignore_eos"]


@pytest.mark.fast
def test_poisson_arrivals_have_the_requested_rate() -> None:
    gaps = bs.arrival_delays(random.Random(0), 20000, rate=4.0)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert bs.arrival_delays(random.Random(0), 3, float("inf")) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        bs.arrival_delays(random.Random(0), 3, 0.0)
