"""The sampler draws the same tokens as before its GPU changes, for the same seeds.

Removing top-p's host sync on the GPU, drawing only the seeded rows one by one and reading token
histories only for rows with a penalty must not move a single draw on the CPU: `EXPECTED` holds
what the sampler drew before those changes (commit c9f92ba) for a grid of temperature x top_p x
top_k x seeded / unseeded rows, in batches that take each path (top-p on candidates and on the
full sort, top-k, min-p, all seeded, mixed, penalties with min_tokens), over three steps whose
generators carry on. `draws` runs a scenario with any sampler module, which is how they were
recorded.
"""

from __future__ import annotations

import itertools
from types import ModuleType

import pytest
import torch

import pdmesh.engine.worker.sampler as sampler_module
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduling.sequence import Sequence
from pdmesh.engine.worker.sampler import Sampler, SamplingMetadata
from pdmesh.engine.worker.step_sampling import StepSampler

pytestmark = pytest.mark.fast

VOCAB = 1000  # above TOP_P_CANDIDATES: top-p may take the candidates or the full sort
STEPS = 3

GRID = [
    SamplingParams(temperature=t, top_p=p, top_k=k, seed=s)
    for t, p, k, s in itertools.product((0.0, 0.6, 1.3), (1.0, 0.95, 0.6), (0, 5, 300),
                                        (None, 11))
]


def _scenarios() -> dict[str, list[SamplingParams]]:
    unseeded = [p for p in GRID if p.seed is None]
    return {
        "grid": GRID,  # seeded rows among the others: the full-row draw
        "unseeded": unseeded,  # rows without a mask: every row on the full row
        # top-k and top-p-only rows on the candidates (top-p's nucleus checked against the row)
        "masked": [p for p in unseeded if 0 < p.top_k <= 256 or (p.top_p < 1 and not p.top_k)],
        "top_k": [SamplingParams(temperature=t, top_k=k, top_p=p)  # the k best only
                  for t in (0.5, 1.2) for k in (5, 40) for p in (1.0, 0.9)],
        "top_p_only": [SamplingParams(temperature=t, top_p=p)
                       for t in (0.5, 1.0, 1.5) for p in (0.3, 0.8, 0.95)],
        "all_seeded": [p for p in GRID if p.seed is not None],
        "min_p": [SamplingParams(temperature=0.9, min_p=m, top_p=p, seed=s)
                  for m in (0.05, 0.2) for p in (1.0, 0.9) for s in (None, 5)],
        "penalties": [
            SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3),
            SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4),
            SamplingParams(temperature=1.0, min_tokens=10, stop_token_ids=[3], seed=2),
            SamplingParams(temperature=0.7, top_k=40, logit_bias={7: 5.0}),
            SamplingParams(temperature=0.0),
        ],
    }


SCENARIOS = _scenarios()
PEAKED = {"masked_peaked", "top_p_only_peaked"}
SCENARIOS["masked_peaked"] = SCENARIOS["masked"]
SCENARIOS["top_p_only_peaked"] = SCENARIOS["top_p_only"]


def draws(module: ModuleType, scenario: str) -> list[list[int]]:
    """`STEPS` steps of `scenario` through `module`'s sampler (this one, or a copy of an older
    one): the token ids of each step."""
    params = SCENARIOS[scenario]
    rows = len(params)
    generators = [module.make_generator(None if p.seed is None else p.seed + i)
                  for i, p in enumerate(params)]
    sampler = module.Sampler(seed=1234)
    gen = torch.Generator().manual_seed(99)
    prompts = [[(7 * i + j) % VOCAB for j in range(12)] for i in range(rows)]
    outputs: list[list[int]] = [[] for _ in range(rows)]
    steps = []
    for _ in range(STEPS):
        # Peaked and flat rows in turn (top-p's nucleus inside the candidates, or not), or
        # peaked rows only: the candidates then hold every row's nucleus.
        peaked = scenario in PEAKED
        scale = torch.tensor([6.0 if peaked or i % 2 else 0.4 for i in range(rows)]).unsqueeze(1)
        logits = torch.randn(rows, VOCAB, generator=gen) * scale
        meta = module.SamplingMetadata(params, generators, prompts,
                                       [list(o) for o in outputs], {0})
        ids = [t.token_id for t in sampler(logits, meta)]
        for out, token in zip(outputs, ids, strict=True):
            out.append(token)
        steps.append(ids)
    return steps


EXPECTED: dict[str, list[list[int]]] = {  # recorded with the sampler of commit c9f92ba
    "grid": [
        [940, 428, 681, 375, 366, 119, 332, 234, 215, 163, 146, 169, 136, 783, 150, 971, 650,
         327, 29, 631, 344, 627, 274, 851, 345, 616, 164, 7, 755, 994, 56, 183, 505, 741, 664,
         398, 334, 260, 962, 435, 586, 645, 770, 723, 936, 135, 292, 515, 689, 536, 304, 652,
         660, 154],
        [486, 495, 911, 4, 175, 371, 844, 237, 117, 335, 43, 363, 456, 242, 240, 601, 92, 174,
         255, 364, 421, 0, 540, 154, 293, 131, 196, 287, 668, 811, 974, 510, 944, 770, 463, 74,
         473, 346, 626, 339, 194, 303, 664, 142, 480, 944, 808, 77, 323, 933, 202, 835, 628, 570],
        [951, 424, 112, 64, 634, 742, 189, 160, 564, 351, 439, 942, 587, 76, 902, 681, 369, 352,
         837, 172, 283, 589, 958, 250, 78, 846, 875, 809, 0, 925, 559, 543, 458, 366, 289, 644,
         709, 493, 325, 56, 51, 99, 886, 740, 868, 576, 746, 817, 883, 540, 593, 417, 794, 580],
    ],
    "unseeded": [
        [940, 428, 681, 375, 366, 119, 332, 234, 215, 163, 146, 169, 367, 765, 692, 371, 650,
         327, 335, 631, 590, 627, 677, 407, 653, 616, 645],
        [756, 473, 452, 226, 852, 35, 149, 28, 728, 389, 629, 208, 316, 485, 600, 831, 939, 903,
         468, 739, 131, 599, 96, 672, 327, 514, 672],
        [454, 463, 879, 331, 143, 339, 812, 205, 85, 915, 408, 331, 81, 210, 1, 569, 327, 142,
         708, 332, 56, 928, 892, 122, 897, 492, 785],
    ],
    "masked": [
        [940, 428, 681, 375, 366, 119, 523, 234, 59, 163, 346, 169, 535, 765, 150],
        [388, 618, 295, 992, 475, 192, 707, 439, 727, 910, 648, 840, 937, 473, 424],
        [444, 151, 259, 709, 702, 366, 489, 228, 65, 403, 711, 720, 833, 177, 13],
    ],
    "top_k": [
        [940, 428, 233, 375, 366, 119, 932, 258],
        [561, 163, 46, 169, 599, 765, 104, 643],
        [797, 327, 802, 631, 344, 627, 526, 851],
    ],
    "top_p_only": [
        [940, 428, 421, 375, 383, 119, 471, 258, 671],
        [445, 267, 949, 831, 497, 524, 340, 618, 408],
        [913, 599, 422, 595, 639, 819, 641, 929, 39],
    ],
    "all_seeded": [
        [940, 428, 681, 375, 366, 119, 332, 234, 215, 163, 82, 169, 777, 783, 680, 971, 241, 327,
         460, 815, 937, 627, 785, 461, 304, 616, 47],
        [756, 473, 452, 226, 852, 35, 149, 28, 728, 389, 36, 208, 192, 789, 961, 203, 428, 903,
         895, 739, 436, 564, 29, 146, 2, 514, 361],
        [454, 463, 879, 331, 143, 339, 812, 205, 85, 303, 805, 56, 516, 876, 972, 569, 424, 762,
         938, 332, 666, 763, 765, 122, 585, 99, 402],
    ],
    "min_p": [
        [28, 428, 408, 528, 243, 119, 376, 258],
        [57, 163, 695, 169, 50, 765, 466, 971],
        [676, 461, 341, 517, 798, 100, 598, 407],
    ],
    "penalties": [
        [31, 428, 939, 375, 366],
        [262, 167, 878, 903, 962],
        [54, 137, 31, 751, 118],
    ],
    "masked_peaked": [
        [940, 428, 681, 375, 366, 119, 332, 234, 215, 163, 146, 169, 136, 765, 150],
        [388, 618, 295, 992, 475, 192, 736, 439, 783, 910, 761, 840, 756, 473, 452],
        [444, 151, 259, 709, 702, 366, 631, 228, 930, 403, 393, 720, 195, 177, 13],
    ],
    "top_p_only_peaked": [
        [940, 428, 681, 375, 366, 119, 332, 258, 561],
        [962, 267, 127, 831, 22, 524, 388, 618, 40],
        [169, 599, 838, 595, 645, 819, 211, 929, 975],
    ],
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_same_draws_as_before(scenario: str) -> None:
    assert draws(sampler_module, scenario) == EXPECTED[scenario]


def _sequence(i: int, params: SamplingParams) -> Sequence:
    tokens = [(5 * i + j) % VOCAB for j in range(40)]
    return Sequence(f"s{i}", f"r{i}", 0, tokens, 30, params)  # 30 prompt, 10 output tokens


def test_token_histories_are_read_only_for_rows_with_a_penalty() -> None:
    """The step's metadata copies no history for rows without a penalty, and the sampler
    draws what it draws when given every row's history."""
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, repetition_penalty=1.2),
              SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5),
              SamplingParams(temperature=0.0, min_tokens=12, stop_token_ids=[4])]
    seqs = [_sequence(i, p) for i, p in enumerate(params)]
    step = StepSampler(Sampler(seed=0), eos_token_ids=[0], device=torch.device("cpu"))
    meta = step._metadata(seqs, [None] * len(seqs))
    assert [bool(ids) for ids in meta.prompt_token_ids] == [False, False, True, True, False]
    assert [bool(ids) for ids in meta.output_token_ids] == [False, False, True, True, False]
    assert meta.num_output_tokens == [10] * len(seqs)
    full = SamplingMetadata(params, [None] * len(seqs), [s.prompt_token_ids for s in seqs],
                            [s.output_token_ids for s in seqs], {0})
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(3))
    lean_ids = Sampler(seed=5).sample_ids(logits, meta)
    assert torch.equal(lean_ids, Sampler(seed=5).sample_ids(logits, full))
    # min_tokens still reads the output length: 10 < 12, so EOS 0 and stop token 4 are banned.
    banned = logits.clone()
    banned[4, [0, 4]] = 100.0
    assert Sampler(seed=5).sample_ids(banned, meta)[4].item() not in (0, 4)


def test_metadata_rows_must_agree() -> None:
    with pytest.raises(ValueError, match="num_output_tokens has 1 rows, params has 2"):
        SamplingMetadata([SamplingParams()] * 2, [None] * 2, [[], []], [[], []], set(), [3])
