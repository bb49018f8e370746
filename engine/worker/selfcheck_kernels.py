"""The self-check's kernel and sampler checks: the device's layer ops and attention backend
against the torch reference on tensors of the model's shape, and the on-device sampler's common
modes with host synchronisation made an error (engine/worker/selfcheck.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.worker.models.architecture import ModelConfig
from pdmesh.engine.worker.sampler import Sampler, SamplingMetadata, make_generator
from pdmesh.engine.worker.selfcheck_result import (
    CheckResult,
    Skip,
    dtype_name,
    first_problem,
    mismatch,
    randn,
    run_check,
)
from pdmesh.kernels.backend import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from pdmesh.kernels.layer_ops import LayerOps, TorchLayerOps, select_layer_ops


def check_layer_ops(device: torch.device, dtype: torch.dtype, mc: ModelConfig,
                    ops: LayerOps | None = None, reference: LayerOps | None = None,
                    num_tokens: int = 37) -> CheckResult:
    """The fused layer ops (`select_layer_ops(device)` unless given) against the reference on
    random tensors of the model's shape; q and k are strided views of one QKV row, as the
    model rotates them."""
    ops = ops if ops is not None else select_layer_ops(device)
    reference = reference if reference is not None else TorchLayerOps()

    def body() -> str | None:
        if ops.name == reference.name:
            raise Skip(f"the {ops.name} ops are the reference")
        t, h, d = num_tokens, mc.hidden_size, mc.head_dim
        hq, hk, eps = mc.num_heads, mc.num_kv_heads, mc.rms_norm_eps

        def rand(*shape: int, seed: int) -> torch.Tensor:
            return randn(*shape, device=device, dtype=dtype, seed=seed)

        x, res, weight = rand(t, h, seed=1), rand(t, h, seed=2), 1 + 0.1 * rand(h, seed=3)
        res_got, res_ref = res.clone(), res.clone()
        added = (ops.add_rms_norm(x, res_got, weight, eps),
                 reference.add_rms_norm(x, res_ref, weight, eps))
        qkv = rand(t, (hq + 2 * hk) * d, seed=4)
        qkv_ref = qkv.clone()
        positions = torch.randint(0, 4096, (t, 1), generator=torch.Generator().manual_seed(5))
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        angles = positions.float() * inv_freq
        cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
        for tensor, rope in ((qkv, ops), (qkv_ref, reference)):
            q = tensor[:, : hq * d].view(t, hq, d)
            k = tensor[:, hq * d : (hq + hk) * d].view(t, hk, d)
            rope.rope_(q, k, cos, sin)
        gate_up = rand(t, 2 * mc.intermediate_size, seed=6)
        return first_problem(
            mismatch("rms_norm", ops.rms_norm(x, weight, eps),
                     reference.rms_norm(x, weight, eps), dtype),
            mismatch("add_rms_norm", added[0], added[1], dtype),
            mismatch("add_rms_norm residual", res_got, res_ref, dtype),
            mismatch("rope", qkv, qkv_ref, dtype),
            mismatch("silu_and_mul", ops.silu_and_mul(gate_up),
                     reference.silu_and_mul(gate_up), dtype),
        )

    return run_check(f"layer_ops[{dtype_name(dtype)}]", device,
                     ("layer_ops", "cuda_graphs"), body)


@dataclass
class _MixedStep:
    """One attention step's inputs: decode rows, then a fresh prompt chunk and a chunk after
    a cached prefix, over a cache whose earlier tokens are random."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_layer: torch.Tensor
    slot_mapping: torch.Tensor
    decode_lens: list[int]
    prefill_lens: list[tuple[int, int]]  # (context, chunk)
    tables: torch.Tensor  # [decodes + prefills, width]

    def meta(self) -> AttentionMetadata:
        """A fresh metadata per backend: backends cache derived tensors in it."""
        nd = len(self.decode_lens)
        starts = [0]
        for _, chunk in self.prefill_lens:
            starts.append(starts[-1] + chunk)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            num_decode_tokens=nd,
            decode_block_tables=self.tables[:nd],
            decode_seq_lens=torch.tensor(self.decode_lens, device=self.query.device),
            prefill_query_start_loc=starts,
            prefill_seq_lens=[ctx for ctx, _ in self.prefill_lens],
            prefill_block_tables=self.tables[nd:],
        )


def mixed_step(mc: ModelConfig, block_size: int, device: torch.device, dtype: torch.dtype,
               seed: int = 0) -> _MixedStep:
    """Decode contexts of 1, a block and some, 20 blocks and some (several splits of the
    Triton decode kernel: a split is at least 8 blocks), 3 blocks; a fresh 2-block chunk;
    a 19-token chunk after a 2-block prefix. Blocks are scattered over the cache."""
    bs = block_size
    decode_lens = [1, bs + 3, 20 * bs + 5, 3 * bs]
    prefill_lens = [(2 * bs + 7, 2 * bs + 7), (2 * bs + 1 + 19, 19)]
    contexts = decode_lens + [ctx for ctx, _ in prefill_lens]
    needs = [-(-ctx // bs) for ctx in contexts]
    num_blocks = sum(needs) + 3
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needs)
    tables = torch.zeros((len(contexts), width), dtype=torch.int64)
    slots: list[int] = []
    for row, (ctx, nb) in enumerate(zip(contexts, needs, strict=True)):
        tables[row, :nb] = torch.tensor(order[:nb])
        order = order[nb:]
        new = 1 if row < len(decode_lens) else prefill_lens[row - len(decode_lens)][1]
        slots += [int(tables[row, p // bs]) * bs + p % bs for p in range(ctx - new, ctx)]
    t, hq, hk, d = len(slots), mc.num_heads, mc.num_kv_heads, mc.head_dim
    return _MixedStep(
        query=randn(t, hq, d, device=device, dtype=dtype, seed=seed + 1),
        key=randn(t, hk, d, device=device, dtype=dtype, seed=seed + 2),
        value=randn(t, hk, d, device=device, dtype=dtype, seed=seed + 3),
        kv_layer=randn(2, num_blocks, bs, hk, d, device=device, dtype=dtype, seed=seed + 4),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        decode_lens=decode_lens,
        prefill_lens=prefill_lens,
        tables=tables.to(device),
    )


def check_attention(device: torch.device, dtype: torch.dtype, mc: ModelConfig, block_size: int,
                    backend: AttentionBackend, reference: AttentionBackend | None = None
                    ) -> CheckResult:
    """`backend` against the reference on one mixed step of the model's head shape: the
    output of every row, and the whole cache afterwards (the step's K/V written where its
    slots say, nothing else touched)."""
    reference = reference if reference is not None else TorchAttentionBackend()

    def body() -> str | None:
        if backend.name == reference.name:
            raise Skip(f"the {backend.name} backend is the reference")
        step = mixed_step(mc, block_size, device, dtype)
        scale = mc.head_dim ** -0.5
        nd = len(step.decode_lens)
        problems: list[str | None] = []
        # Full attention, and a sliding window where the model's layers use one: narrowed to
        # the probe's contexts (2 blocks and some) so that it masks something here.
        for window in sorted({0} | {min(w, 2 * block_size + 5) for w in mc.windows if w}):
            cache_got, cache_ref = step.kv_layer.clone(), step.kv_layer.clone()
            got = backend.forward(step.query, step.key, step.value, cache_got, step.meta(),
                                  scale, window)
            ref = reference.forward(step.query, step.key, step.value, cache_ref, step.meta(),
                                    scale, window)
            where = f" (window {window})" if window else ""
            problems += [mismatch("decode rows" + where, got[:nd], ref[:nd], dtype),
                         mismatch("prefill rows" + where, got[nd:], ref[nd:], dtype),
                         mismatch("kv cache" + where, cache_got, cache_ref, dtype)]
        return first_problem(*problems)

    return run_check(f"attention[{dtype_name(dtype)}]", device, ("attention", "cuda_graphs"),
                     body)


# -- the sampler -----------------------------------------------------------------------------------


SAMPLER_MODES: tuple[tuple[str, SamplingParams], ...] = (
    ("greedy", SamplingParams(temperature=0.0)),
    ("temperature", SamplingParams(temperature=0.8)),
    ("top-p", SamplingParams(temperature=1.0, top_p=0.9)),
    ("top-k", SamplingParams(temperature=1.0, top_k=20)),
    ("seeded", SamplingParams(temperature=0.9, top_p=0.95, seed=7)),
    ("greedy", SamplingParams(temperature=0.0)),
)
"""The common modes: chat defaults are top-p alone (SmolLM2, Llama-3-Instruct)."""


@contextmanager
def no_host_sync(device: torch.device) -> Iterator[None]:
    """Any host synchronisation on `device` raises inside (CUDA only: a CPU has none)."""
    if device.type != "cuda":
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def support_problem(mode: str, params: SamplingParams, row: torch.Tensor, token: int
                    ) -> str | None:
    """Whether `token` may be drawn from logits `row` under `params` (greedy: the argmax;
    top-k: among the k largest; top-p: inside the nucleus)."""
    if not 0 <= token < row.numel():
        return f"{mode}: id {token} outside the vocabulary"
    if params.is_greedy:
        return None if token == int(row.argmax()) else f"{mode}: {token} is not the argmax"
    if params.top_k > 0:
        kth = torch.topk(row, params.top_k).values[-1]
        if row[token] < kth:
            return f"{mode}: {token} is outside the top {params.top_k}"
    if params.top_p < 1.0:
        probs = torch.softmax(row.double() / params.temperature, dim=-1)
        mass_above = float(probs[probs > probs[token]].sum())
        if mass_above >= params.top_p + 1e-4:
            return f"{mode}: {token} is outside the top-p {params.top_p} nucleus"
    return None


def check_sampler(device: torch.device, vocab_size: int, sampler: Sampler | None = None
                  ) -> CheckResult:
    """The on-device sampling that async scheduling launches (`Sampler.sample_ids`) for the
    common modes in one batch, with no host synchronisation; each id inside its row's support,
    and the seeded row drawing the same id again from a fresh generator of its seed."""
    sampler = sampler if sampler is not None else Sampler(seed=0, device=device)

    def body() -> str | None:
        params = [p for _, p in SAMPLER_MODES]
        # Unit-variance logits: no row is nearly one-hot, so a seeded row that ignored its
        # generator would draw differently the second time.
        logits = randn(len(params), vocab_size, device=device, dtype=torch.float32, seed=9)

        def draw() -> list[int]:
            meta = SamplingMetadata(params, [make_generator(p.seed, device) for p in params],
                                    [[1, 2, 3]] * len(params), [[]] * len(params), set())
            with no_host_sync(device):
                ids = sampler.sample_ids(logits, meta)
            return ids.tolist()

        first, again = draw(), draw()
        host = logits.cpu()
        problems = [support_problem(mode, p, host[i], first[i])
                    for i, (mode, p) in enumerate(SAMPLER_MODES)]
        seeded = [i for i, (_, p) in enumerate(SAMPLER_MODES) if p.seed is not None]
        problems += [f"seeded: {first[i]} then {again[i]} from the same seed"
                     for i in seeded if first[i] != again[i]]
        return first_problem(*problems)

    return run_check("sampler", device, ("async_scheduling",), body)
