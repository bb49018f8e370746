"""The sampler on a GPU: all per-row work stays on the device, one host copy per step.

`torch.cuda.set_sync_debug_mode("warn")` makes every synchronising call (an `.item()`, a
`.tolist()`, a blocking host-to-device copy, a data-dependent `unique()`) emit a warning, so
counting them checks the contract: a mixed batch — greedy, seeded and unseeded random rows
with top-k/top-p/min-p, penalties, logit bias and a min_tokens ban — costs exactly one. The
ids alone (`sample_ids`, what async scheduling leaves in flight) cost none: under
`set_sync_debug_mode("error")` any synchronisation raises.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.worker.sampler import Sampler, SamplingMetadata, make_generator

pytestmark = pytest.mark.fast

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROWS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias={5: 3.0}),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7),
    SamplingParams(temperature=1.0, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(temperature=0.7, top_p=0.8, min_tokens=4, stop_token_ids=[9]),
]


def _meta(device: torch.device) -> SamplingMetadata:
    return SamplingMetadata(
        params=ROWS,
        generators=[make_generator(p.seed, device) for p in ROWS],
        prompt_token_ids=[[1, 2, 3, 2]] * len(ROWS),
        output_token_ids=[[4, 4, 6]] * len(ROWS),
        eos_token_ids={0},
    )


def _sync_warnings(fn) -> tuple[object, int]:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    return result, len(syncs)


@needs_cuda
def test_a_mixed_batch_synchronises_once() -> None:
    cuda = torch.device("cuda")
    logits = torch.randn(len(ROWS), 512, generator=torch.Generator().manual_seed(0)).to(cuda)
    sampler = Sampler(seed=0, device=cuda)
    sampler(logits, _meta(cuda))  # warm-up: lazy CUDA initialisation is not the sampler's
    tokens, syncs = _sync_warnings(lambda: sampler(logits, _meta(cuda)))
    assert len(tokens) == len(ROWS)  # type: ignore[arg-type]
    assert syncs == 1, f"{syncs} device synchronisations in one sampler call, expected 1"


COMMON_MODES = {
    "greedy": [SamplingParams(temperature=0.0)],
    # The default chat sampling of SmolLM2 and Llama-3-Instruct: top-p only.
    "top_p": [SamplingParams(temperature=0.6, top_p=0.9)],
    "top_k": [SamplingParams(temperature=0.8, top_k=50)],
    "top_k_top_p": [SamplingParams(temperature=0.7, top_k=40, top_p=0.95)],
    "min_p": [SamplingParams(temperature=1.0, min_p=0.05)],
    "temperature": [SamplingParams(temperature=1.0)],
    "seeded_top_p": [SamplingParams(temperature=0.6, top_p=0.9, seed=3)],
    # vLLM's allowed_token_ids: the mask is built on the device, no sync either.
    "allowed_token_ids": [SamplingParams(temperature=0.8, allowed_token_ids=[3, 17, 400])],
    "mixed": ROWS,
}


@needs_cuda
@pytest.mark.parametrize("mode", list(COMMON_MODES))
def test_common_modes_leave_the_ids_on_the_device_without_a_sync(mode: str) -> None:
    cuda = torch.device("cuda")
    params = COMMON_MODES[mode] * (1 if mode == "mixed" else 8)
    rows, vocab = len(params), 49152
    gen = torch.Generator().manual_seed(2)
    # Peaked rows: top-p's nucleus lies within its first candidates, the CPU's shortcut.
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(cuda)
    meta = SamplingMetadata(params, [make_generator(p.seed, cuda) for p in params],
                            [[1, 2, 3, 2]] * rows, [[4, 4, 6]] * rows, {0})
    sampler = Sampler(seed=0, device=cuda)
    sampler.sample_ids(logits, meta)  # warm-up: lazy CUDA initialisation is not the sampler's
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids = sampler.sample_ids(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ids.shape == (rows,) and ids.device.type == "cuda"
    assert bool(((ids >= 0) & (ids < vocab)).all())


@needs_cuda
def test_top_p_on_cuda_keeps_what_the_cpu_keeps() -> None:
    """On CUDA top-p takes the full sort, where the CPU may take its candidates: the same
    distribution (a row whose nucleus is one token draws that token on both)."""
    logits = torch.full((4, 49152), -10.0)
    logits[:, 17] = 10.0  # the nucleus of top_p 0.9 is token 17 alone
    params = [SamplingParams(temperature=0.6, top_p=0.9)] * 4
    meta_args = ([None] * 4, [[]] * 4, [[]] * 4, set())
    on_cpu = Sampler(seed=0).sample_ids(logits, SamplingMetadata(params, *meta_args))
    cuda = torch.device("cuda")
    on_gpu = Sampler(seed=0, device=cuda).sample_ids(logits.to(cuda),
                                                    SamplingMetadata(params, *meta_args))
    assert on_cpu.tolist() == on_gpu.tolist() == [17] * 4


@needs_cuda
def test_greedy_rows_agree_with_cpu() -> None:
    """Deterministic rows (greedy, with penalties and bias) pick the same ids on both."""
    logits = torch.randn(len(ROWS), 512, generator=torch.Generator().manual_seed(1))
    on_cpu = Sampler(seed=0)(logits, _meta(torch.device("cpu")))
    cuda = torch.device("cuda")
    on_gpu = Sampler(seed=0, device=cuda)(logits.to(cuda), _meta(cuda))
    assert [t.token_id for t in on_gpu[:2]] == [t.token_id for t in on_cpu[:2]]
