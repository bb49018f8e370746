"""Backend selection, and the CPU backend against the reference backend.

Selection is a pure function of an `Environment` (device type, what is installed, the
interpreter flag), so the CUDA rows of the table are checked here without a GPU.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from pdmesh.kernels import cpu_native, torch_ref
from pdmesh.kernels.backend import BLOCK_SIZES, AttentionMetadata, TorchAttentionBackend
from pdmesh.kernels.backend_selection import (
    Environment,
    available_backends,
    get_attention_backend,
    select_backend,
)
from pdmesh.kernels.cpu_attention import CpuAttentionBackend, gather_kv
from pdmesh.kernels.flash_attn_backend import _fallback

pytestmark = pytest.mark.fast

CPU = Environment("cpu", has_flash_attn=False, has_triton=True, triton_interpret=False)
CUDA_ALL = Environment("cuda", has_flash_attn=True, has_triton=True, triton_interpret=False)
CUDA_TRITON = Environment("cuda", has_flash_attn=False, has_triton=True, triton_interpret=False)
CUDA_BARE = Environment("cuda", has_flash_attn=False, has_triton=False, triton_interpret=False)


@pytest.mark.parametrize(
    ("env", "expected"),
    [(CPU, "cpu"), (CUDA_ALL, "triton"), (CUDA_TRITON, "triton"), (CUDA_BARE, "torch")],
)
def test_auto_picks_triton_on_cuda_even_with_flash_attn_and_cpu_path_on_cpu(env, expected):
    """flash-attn cannot read a cache of the block sizes the config allows and turns CUDA
    graphs off: under auto it would make decode slower, so auto never picks it."""
    for block_size in (None, 16, 128):
        assert select_backend("auto", env, block_size) == expected
        assert select_backend(None, env, block_size) == expected


def test_auto_skips_triton_for_a_block_size_its_kernels_cannot_take(caplog):
    assert BLOCK_SIZES["triton"] == (16, 32, 64, 128)
    with caplog.at_level(logging.WARNING, logger="pdmesh.kernels.backend_selection"):
        assert select_backend("auto", CUDA_ALL, block_size=8) == "torch"
    assert "block_size in 16/32/64/128, got 8; using torch" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pdmesh.kernels.backend_selection"):
        assert select_backend("auto", CUDA_TRITON, block_size=32) == "triton"
    assert caplog.text == ""  # nothing skipped, nothing said
    assert available_backends(CUDA_ALL, block_size=8) == ["flash-attn", "torch"]
    assert available_backends(CUDA_ALL, block_size=16) == ["flash-attn", "triton", "torch"]


@pytest.mark.parametrize("env", [CUDA_TRITON, Environment("cpu", False, True, True)])
def test_explicit_triton_with_a_block_size_its_kernels_cannot_take_is_refused(env):
    with pytest.raises(ValueError, match="cannot run here") as err:
        select_backend("triton", env, block_size=8)
    assert "the triton kernels need block_size in 16/32/64/128, got 8" in str(err.value)
    assert select_backend("triton", env, block_size=16) == "triton"
    assert select_backend("torch", env, block_size=8) == "torch"


def test_flash_attn_falls_back_to_what_takes_the_block_size():
    """flash-attn hands paged reads to Triton, or to the reference where Triton cannot take
    the cache's blocks."""
    assert isinstance(_fallback(8), TorchAttentionBackend)
    if importlib.util.find_spec("triton") is not None:
        assert _fallback(16).name == "triton"
        assert _fallback(None).name == "triton"


def test_prefill_tensors_are_the_staged_ones_or_the_host_lists_copied_once():
    lists = dict(slot_mapping=torch.zeros(5, dtype=torch.long), num_decode_tokens=0,
                 decode_block_tables=torch.zeros(0, 1, dtype=torch.long),
                 decode_seq_lens=torch.zeros(0, dtype=torch.long),
                 prefill_query_start_loc=[0, 2, 5], prefill_seq_lens=[9, 3],
                 prefill_block_tables=torch.zeros(2, 3, dtype=torch.long))
    meta = AttentionMetadata(**lists)
    qsl, lens = meta.prefill_tensors(torch.device("cpu"))
    assert qsl.tolist() == [0, 2, 5] and lens.tolist() == [9, 3]
    assert qsl.dtype == lens.dtype == torch.int64
    assert meta.prefill_tensors(torch.device("cpu"))[0] is qsl  # once per step
    staged_qsl, staged_lens = torch.tensor([0, 2, 5]), torch.tensor([9, 3])
    staged = AttentionMetadata(**lists, prefill_query_start_loc_tensor=staged_qsl,
                               prefill_seq_lens_tensor=staged_lens)
    assert staged.prefill_tensors(torch.device("cpu")) == (staged_qsl, staged_lens)


def test_explicit_names_and_aliases():
    assert select_backend("torch", CPU) == "torch"
    assert select_backend("flash_attn", CUDA_ALL) == "flash-attn"
    assert select_backend("Triton", CUDA_ALL) == "triton"


@pytest.mark.parametrize(
    ("name", "env", "reason"),
    [
        ("triton", CPU, "TRITON_INTERPRET=1"),
        ("triton", CUDA_BARE, "triton is not installed"),
        ("flash-attn", CPU, "needs a CUDA device"),
        ("flash-attn", CUDA_TRITON, "pip install 'pdmesh[flash-attn]'"),
        ("cpu", CUDA_ALL, "CPU tensors only"),
        ("xformers", CPU, "unknown backend"),
    ],
)
def test_a_backend_that_cannot_run_here_is_a_clear_error(name, env, reason):
    with pytest.raises(ValueError, match="cannot run here") as err:
        select_backend(name, env)
    assert reason in str(err.value)
    assert "available here" in str(err.value)


def test_triton_on_cpu_is_allowed_with_the_interpreter():
    env = Environment("cpu", has_flash_attn=False, has_triton=True, triton_interpret=True)
    assert select_backend("triton", env) == "triton"
    assert available_backends(env) == ["triton", "cpu", "torch"]


def test_get_attention_backend_on_this_machine_cpu():
    assert isinstance(get_attention_backend("auto", "cpu"), CpuAttentionBackend)
    assert isinstance(get_attention_backend("torch", "cpu"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="flash-attn needs a CUDA device"):
        get_attention_backend("flash-attn", "cpu")


# -- the CPU backend computes exactly what the reference computes ----------------------------


def random_step(
    seed: int,
    kv_heads: int,
    group: int,
    block_size: int,
    decode_lens: list[int],
    chunks: list[tuple[int, int]],
    head_dim: int = 64,
) -> tuple[AttentionMetadata, torch.Tensor, list[torch.Tensor]]:
    """A mixed step (decodes, then prompt chunks given as (context, chunk length)) over a
    cache with random contents; returns the metadata, the cache and query/key/value."""
    gen = torch.Generator().manual_seed(seed)
    lens = decode_lens + [c for c, _ in chunks]
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), max(need), dtype=torch.long)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(order[:n])
        order = order[n:]

    def slot(seq: int, pos: int) -> int:
        return int(tables[seq, pos // block_size]) * block_size + pos % block_size

    nd = len(decode_lens)
    slots = [slot(i, n - 1) for i, n in enumerate(decode_lens)]
    qsl = [0]
    for j, (c, n) in enumerate(chunks):
        slots += [slot(nd + j, p) for p in range(c - n, c)]
        qsl.append(qsl[-1] + n)
    rows = nd + qsl[-1]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=nd,
        decode_block_tables=tables[:nd],
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.long),
        prefill_query_start_loc=qsl,
        prefill_seq_lens=[c for c, _ in chunks],
        prefill_block_tables=tables[nd:],
    )
    qkv = [
        torch.randn(rows, kv_heads * group, head_dim, generator=gen),
        torch.randn(rows, kv_heads, head_dim, generator=gen),
        torch.randn(rows, kv_heads, head_dim, generator=gen),
    ]
    return meta, kv, qkv


@pytest.mark.parametrize(
    ("kv_heads", "group", "block_size", "decode_lens", "chunks"),
    [
        (3, 3, 16, [1, 17, 300, 40], []),  # decode only (the fast path)
        # decode rows long enough to be attended in several cache-sized groups
        (3, 3, 16, [1, 2000, 17, 1300, 700, 40, 650, 1200, 33], []),
        (1, 8, 32, [900, 5, 2100, 64], [(30, 30), (75, 11)]),
        (1, 8, 32, [5, 64], [(30, 30), (75, 11)]),  # mixed: fresh and cached-prefix chunks
        (2, 1, 16, [], [(16, 16), (49, 1)]),  # prefill only
    ],
)
@pytest.mark.parametrize("native", [True, False], ids=["native", "sdpa"])
@pytest.mark.parametrize("window", [0, 37, 5], ids=["full", "window37", "window5"])
def test_cpu_backend_matches_reference_backend(kv_heads, group, block_size, decode_lens, chunks,
                                               native, window, monkeypatch):
    if native and cpu_native.library() is None:
        pytest.skip("no C compiler: the native CPU kernels cannot be built here")
    if not native:
        monkeypatch.setattr(cpu_native, "supports", lambda *_: False)
    meta, kv, (q, k, v) = random_step(7, kv_heads, group, block_size, decode_lens, chunks)
    ref_cache = kv.clone()
    expected = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, 0.125, window)
    cpu = CpuAttentionBackend()
    actual = cpu.forward(q, k, v, kv, meta, 0.125, window)
    assert torch.equal(kv, ref_cache)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    # A second layer of the same step reuses what the first built, and still agrees; a layer
    # of another window (models that mix them) gets its own masks.
    assert meta.step_cache or not decode_lens or native
    again = cpu.forward(q, k, v, kv, meta, 0.125, window)
    torch.testing.assert_close(again, expected, atol=1e-6, rtol=1e-5)
    full = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, 0.125)
    torch.testing.assert_close(cpu.forward(q, k, v, kv, meta, 0.125), full, atol=1e-6,
                               rtol=1e-5)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int) -> torch.Tensor:
    """Dense attention of the last `len(q)` positions under transformers' sliding mask
    (`kv_idx <= q_idx` and `kv_idx > q_idx - window`), written out."""
    ctx = k.shape[1]
    positions = torch.arange(ctx - q.shape[0], ctx)[:, None]
    keys = torch.arange(ctx)[None, :]
    mask = (keys <= positions) & (keys > positions - window)
    scores = torch.einsum("qhd,hkd->hqk", q, k) * scale
    return torch.einsum("hqk,hkd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("window", [1, 3, 16, 100])
def test_the_reference_window_is_transformers_sliding_mask(window: int) -> None:
    """Query i sees keys i - window + 1 .. i: a chunk after a cached prefix, and a fresh
    prompt (its own keys only), against dense attention under that mask."""
    gen = torch.Generator().manual_seed(3)
    ctx, chunk, heads, dim = 40, 13, 2, 8
    q = torch.randn(chunk, heads, dim, generator=gen)
    k = torch.randn(heads, ctx, dim, generator=gen)
    v = torch.randn(heads, ctx, dim, generator=gen)
    torch.testing.assert_close(torch_ref.prefill_attention_one(q, k, v, 0.5, window),
                               masked_attention(q, k, v, 0.5, window), atol=1e-5, rtol=1e-5)
    fresh_k, fresh_v = k[:, :chunk], v[:, :chunk]
    torch.testing.assert_close(torch_ref.prefill_attention_one(q, fresh_k, fresh_v, 0.5, window),
                               masked_attention(q, fresh_k, fresh_v, 0.5, window),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("head_dim", "block_size", "dtype"), [
    (128, 16, torch.float32),  # Llama's heads: a compiled-in size, like 64
    (80, 16, torch.float32),  # a multiple of 16 the kernel does not specialize
    (72, 16, torch.float32),  # not a multiple of 16: the plain C loops
    (64, 8, torch.float32),  # blocks shorter than 16 tokens
    (64, 24, torch.float32),  # blocks of 16 tokens and a remainder
    (128, 16, torch.bfloat16),
    (72, 8, torch.bfloat16),
])
def test_native_decode_head_sizes_and_block_sizes(head_dim, block_size, dtype) -> None:
    """Every head size and block size the kernel's paths split on (16-token groups, 16-wide
    vectors, compiled-in head sizes) against the float32 reference on the same values."""
    if cpu_native.library() is None:
        pytest.skip("no C compiler: the native CPU kernels cannot be built here")
    lens = [1, 15, 16, 17, 33, 250, 600]
    meta, kv, (q, _, _) = random_step(13, 2, 3, block_size, lens, [], head_dim=head_dim)
    kv, q = kv.to(dtype), q.to(dtype)
    expected = torch_ref.paged_decode_attention(q.float(), kv.float(), meta.decode_block_tables,
                                                meta.decode_seq_lens, head_dim**-0.5)
    actual = cpu_native.paged_decode_attention(q, kv, meta.decode_block_tables,
                                               meta.decode_seq_lens, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual.float(), expected, atol=tol, rtol=tol)


def test_native_decode_kernel_refuses_what_it_cannot_read() -> None:
    if cpu_native.library() is None:
        pytest.skip("no C compiler: the native CPU kernels cannot be built here")
    meta, kv, (q, _, _) = random_step(5, 2, 2, 16, [40, 3], [])
    tables = meta.decode_block_tables.clone()
    tables[0, 1] = kv.shape[1]  # one past the last block
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_native.paged_decode_attention(q, kv, tables, meta.decode_seq_lens, 0.125)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.paged_decode_attention(q[:, :3], kv, meta.decode_block_tables,
                                          meta.decode_seq_lens, 0.125)
    assert not cpu_native.supports(q.to(torch.float16), kv.to(torch.float16))
    assert not cpu_native.supports(q.to(torch.bfloat16), kv)  # mixed dtypes: the SDPA path


@pytest.mark.parametrize(("kv_heads", "group", "block_size", "decode_lens", "chunks"), [
    (3, 3, 16, [1, 17, 300, 40], []),
    (1, 8, 32, [900, 5, 2100, 64], [(30, 30), (75, 11)]),
])
def test_native_bfloat16_decode_is_the_float32_math_rounded_once(kv_heads, group, block_size,
                                                                  decode_lens, chunks) -> None:
    """In bfloat16 the native kernels read the cache's bfloat16 K/V, compute in float32 and
    round the output once: the float32 reference on the same bfloat16 values, rounded, up to
    one bfloat16 step; the step's K/V rows land in the cache bit for bit."""
    if cpu_native.library() is None:
        pytest.skip("no C compiler: the native CPU kernels cannot be built here")
    meta, kv, qkv = random_step(11, kv_heads, group, block_size, decode_lens, chunks)
    kv16 = kv.to(torch.bfloat16)
    q16, k16, v16 = (t.to(torch.bfloat16) for t in qkv)
    assert cpu_native.supports(q16, kv16) and cpu_native.can_cache(k16, v16, kv16,
                                                                   meta.slot_mapping)
    ref_cache = kv16.float()
    expected = TorchAttentionBackend().forward(q16.float(), k16.float(), v16.float(), ref_cache,
                                               meta, 0.125)
    actual = CpuAttentionBackend().forward(q16, k16, v16, kv16, meta, 0.125)
    assert actual.dtype == torch.bfloat16
    assert torch.equal(kv16.float(), ref_cache)
    nd = meta.num_decode_tokens  # the decode rows: the native kernel's
    torch.testing.assert_close(actual[:nd].float(), expected[:nd].to(torch.bfloat16).float(),
                               atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(actual.float(), expected, atol=2e-2, rtol=2e-2)


def test_native_cache_write_takes_qkv_views_and_refuses_slots_outside_the_cache() -> None:
    if cpu_native.library() is None:
        pytest.skip("no C compiler: the native CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(3)
    kv = torch.zeros(2, 6, 4, 2, 8)
    qkv = torch.randn(5, (4 + 2 + 2) * 8, generator=gen)
    _, k, v = qkv.split([32, 16, 16], dim=-1)
    k, v = k.view(5, 2, 8), v.view(5, 2, 8)  # strided rows, as the model passes them
    slots = torch.tensor([0, 7, 9, 23, 12])
    assert cpu_native.can_cache(k, v, kv, slots)
    expected = kv.clone()
    torch_ref.reshape_and_cache(k, v, expected, slots)
    cpu_native.reshape_and_cache(k, v, kv, slots)
    assert torch.equal(kv, expected)
    with pytest.raises(IndexError, match="outside the KV cache"):
        cpu_native.reshape_and_cache(k, v, kv, torch.tensor([0, 1, 2, 24, 3]))
    assert not cpu_native.can_cache(k, v, kv, slots.to(torch.int32))


def test_native_kernels_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.setenv(cpu_native.DISABLE_ENV, "0")
    cpu_native.library.cache_clear()
    try:
        assert cpu_native.library() is None
    finally:
        cpu_native.library.cache_clear()


def test_cpu_gather_equals_reference_gather():
    meta, kv, _ = random_step(3, 2, 1, 16, [], [(70, 5)])
    for got, want in zip(
        gather_kv(kv, meta.prefill_block_tables[0], 70),
        torch_ref.gather_kv(kv, meta.prefill_block_tables[0], 70),
        strict=True,
    ):
        assert torch.equal(got, want)
