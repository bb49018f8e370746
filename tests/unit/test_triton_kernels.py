"""The Triton paged-attention kernels against the torch reference, on CPU.

The kernels run in Triton's interpreter, in one child process (tests/triton_interpreter.py):
this file, run as a script, reports each case's outcome; each pytest test asserts one case.

The interpreter is slow, so shapes are small but cover what the kernels branch on: head size
64/128, GQA ratio 1/3/8, block size 16/32, lengths that are not multiples of the block size,
several sequences per launch, one or several KV splits, float32 and bfloat16.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

from pdmesh.kernels import torch_ref
from pdmesh.kernels.backend import AttentionMetadata, TorchAttentionBackend
from tests.triton_interpreter import outcomes_of, run_cases

MODULE = "pdmesh.kernels.triton_attention"
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
CASES: dict[str, Callable[[ModuleType], None]] = {}


def case(name: str) -> Callable:
    def register(fn: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
        CASES[name] = fn
        return fn

    return register


@dataclass
class Paged:
    kv_layer: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # [B, max_blocks], unused entries hold random valid ids
    seq_lens: list[int]


def make_paged(
    gen: torch.Generator,
    seq_lens: list[int],
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> Paged:
    """A cache with random contents and each sequence's blocks scattered at random."""
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(seq_lens), max(need)), generator=gen)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = order[used : used + n]
        used += n
    return Paged(kv, tables, seq_lens)


def slots_of(paged: Paged, seq: int, positions: range) -> list[int]:
    bs = paged.kv_layer.shape[2]
    table = paged.block_tables[seq]
    return [int(table[p // bs]) * bs + p % bs for p in positions]


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _reshape_and_cache(tk: ModuleType, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    paged = make_paged(gen, [21, 9], block_size=16, kv_heads=3, head_dim=64, dtype=dtype)
    key = torch.randn(6, 3, 64, generator=gen).to(dtype)
    value = torch.randn(6, 3, 64, generator=gen).to(dtype)
    slots = slots_of(paged, 0, range(15, 18)) + slots_of(paged, 1, range(8, 9)) + [-1, 2]
    expected = paged.kv_layer.clone()
    keep = [0, 1, 2, 3, 5]  # slot -1 is padding: nothing written
    torch_ref.reshape_and_cache(key[keep], value[keep], expected, torch.tensor(slots)[keep])
    tk.reshape_and_cache(key, value, paged.kv_layer, torch.tensor(slots))
    assert torch.equal(paged.kv_layer, expected)


for _dtype in (torch.float32, torch.bfloat16):
    case(f"reshape_and_cache-{str(_dtype)[6:]}")(
        lambda tk, dtype=_dtype: _reshape_and_cache(tk, dtype)
    )


@case("reshape_and_cache-strided-rows")
def _reshape_and_cache_strided(tk: ModuleType) -> None:
    """K/V arrive as views of the fused QKV projection (row stride > Hkv * D)."""
    gen = torch.Generator().manual_seed(2)
    paged = make_paged(gen, [40], block_size=32, kv_heads=2, head_dim=64, dtype=torch.float32)
    qkv = torch.randn(5, 3 * 2 * 64, generator=gen)
    key, value = qkv[:, 128:256].view(5, 2, 64), qkv[:, 256:].view(5, 2, 64)
    slots = torch.tensor(slots_of(paged, 0, range(30, 35)))
    expected = paged.kv_layer.clone()
    torch_ref.reshape_and_cache(key.contiguous(), value.contiguous(), expected, slots)
    tk.reshape_and_cache(key, value, paged.kv_layer, slots)
    assert torch.equal(paged.kv_layer, expected)


@dataclass(frozen=True)
class DecodeCase:
    head_dim: int
    group: int  # query heads per KV head
    kv_heads: int
    block_size: int
    seq_lens: tuple[int, ...]
    num_splits: int | None  # None: the kernel's own choice
    dtype: torch.dtype
    window: int = 0  # a sliding window; 0: full attention

    @property
    def name(self) -> str:
        return (
            f"decode-d{self.head_dim}-g{self.group}-kv{self.kv_heads}-bs{self.block_size}-"
            f"len{'_'.join(map(str, self.seq_lens))}-s{self.num_splits}-{str(self.dtype)[6:]}"
            + (f"-w{self.window}" if self.window else "")
        )

    def run(self, tk: ModuleType) -> None:
        gen = torch.Generator().manual_seed(self.head_dim + self.group + self.block_size)
        lens = list(self.seq_lens)
        paged = make_paged(gen, lens, self.block_size, self.kv_heads, self.head_dim, self.dtype)
        hq = self.kv_heads * self.group
        query = torch.randn(len(lens), hq, self.head_dim, generator=gen).to(self.dtype)
        scale = self.head_dim**-0.5
        expected = torch_ref.paged_decode_attention(
            query.float(), paged.kv_layer.float(), paged.block_tables, torch.tensor(lens), scale,
            self.window,
        )
        actual = tk.paged_decode_attention(
            query,
            paged.kv_layer,
            paged.block_tables,
            torch.tensor(lens),
            scale,
            num_splits=self.num_splits,
            window=self.window,
        )
        assert actual.dtype == self.dtype
        close(actual, expected, self.dtype)


F32, BF16 = torch.float32, torch.bfloat16
DECODE_CASES = [
    DecodeCase(64, 1, 2, 16, (1, 17, 40), 1, F32),
    DecodeCase(64, 3, 1, 16, (33, 5, 70), 3, F32),
    DecodeCase(128, 8, 1, 32, (31, 65), 2, F32),
    DecodeCase(64, 8, 1, 32, (100, 3), None, BF16),
    DecodeCase(128, 3, 1, 16, (47, 16), 2, BF16),
    DecodeCase(128, 1, 2, 32, (9, 33), 1, BF16),
    # More splits than the short sequence has blocks: empty splits must weigh nothing.
    DecodeCase(64, 3, 1, 16, (130, 2), 9, F32),
    DecodeCase(64, 8, 2, 16, (300, 45, 7), None, BF16),
    # Sliding windows: splits wholly before the window read nothing and weigh nothing; a
    # window inside one block, one across several, one wider than a context.
    DecodeCase(64, 3, 1, 16, (130, 2, 40), 9, F32, window=20),
    DecodeCase(64, 3, 1, 16, (130, 17), 1, F32, window=5),
    DecodeCase(128, 8, 1, 32, (200, 65), None, BF16, window=70),
]
for _c in DECODE_CASES:
    case(_c.name)(_c.run)


@dataclass(frozen=True)
class PrefillCase:
    head_dim: int
    group: int
    kv_heads: int
    block_size: int
    chunks: tuple[tuple[int, int], ...]  # (context length incl. the chunk, chunk length)
    dtype: torch.dtype
    window: int = 0  # a sliding window; 0: full attention

    @property
    def name(self) -> str:
        chunks = "_".join(f"{c}-{n}" for c, n in self.chunks)
        return (
            f"prefill-d{self.head_dim}-g{self.group}-kv{self.kv_heads}-bs{self.block_size}-"
            f"ctx{chunks}-{str(self.dtype)[6:]}" + (f"-w{self.window}" if self.window else "")
        )

    def run(self, tk: ModuleType) -> None:
        """Chunks after a cached prefix and without one, in one launch. The chunk's own K/V
        come from the step's rows, deliberately absent from the kernel's cache."""
        gen = torch.Generator().manual_seed(self.head_dim * self.group + self.block_size)
        ctx = [c for c, _ in self.chunks]
        dims = (self.kv_heads, self.head_dim)
        paged = make_paged(gen, ctx, self.block_size, *dims, self.dtype)
        qsl, slots = [0], []
        for i, (c, n) in enumerate(self.chunks):
            qsl.append(qsl[-1] + n)
            slots += slots_of(paged, i, range(c - n, c))
        rows, hq = qsl[-1], self.kv_heads * self.group
        query = torch.randn(rows, hq, self.head_dim, generator=gen).to(self.dtype)
        key = torch.randn(rows, *dims, generator=gen).to(self.dtype)
        value = torch.randn(rows, *dims, generator=gen).to(self.dtype)
        scale = self.head_dim**-0.5
        full = paged.kv_layer.float().clone()
        torch_ref.reshape_and_cache(key.float(), value.float(), full, torch.tensor(slots))
        expected = torch_ref.paged_prefill_attention(
            query.float(), full, paged.block_tables, qsl, ctx, scale, self.window
        )
        actual = tk.paged_prefill_attention(
            query,
            key,
            value,
            paged.kv_layer,
            paged.block_tables,
            torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(ctx, dtype=torch.int32),
            max(n for _, n in self.chunks),
            scale,
            block_m=16,
            window=self.window,
        )
        close(actual, expected, self.dtype)


PREFILL_CASES = [
    PrefillCase(64, 1, 1, 16, ((21, 21), (37, 20)), F32),
    PrefillCase(64, 3, 1, 32, ((70, 33), (5, 5)), F32),
    PrefillCase(128, 8, 1, 16, ((40, 17),), F32),
    PrefillCase(64, 8, 1, 16, ((19, 19), (50, 3)), BF16),
    PrefillCase(128, 3, 1, 32, ((45, 12),), BF16),
    PrefillCase(64, 3, 2, 16, ((90, 40), (16, 16), (33, 1)), F32),
    # Sliding windows: prefix blocks and chunk tiles wholly outside a row's window, a window
    # narrower than a tile, and one wider than every context.
    PrefillCase(64, 3, 2, 16, ((90, 40), (16, 16), (33, 1)), F32, window=20),
    PrefillCase(64, 1, 1, 16, ((70, 50), (40, 40)), F32, window=3),
    PrefillCase(128, 8, 1, 32, ((100, 35),), BF16, window=37),
    PrefillCase(64, 3, 1, 16, ((45, 12),), F32, window=500),
]
for _c in PREFILL_CASES:
    case(_c.name)(_c.run)


def mixed_step(
    gen: torch.Generator, device: str = "cpu", staged: bool = False
) -> tuple[AttentionMetadata, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A step of two decode rows and two prompt chunks (one after a cached prefix): its
    metadata, cache and query/key/value, on `device`; `staged`: the prefill offsets and
    lengths come as device tensors too, as the input batch stages them."""
    kv_heads, group, head_dim, bs = 1, 3, 64, 16
    decode_lens, chunks = [18, 33], [(24, 24), (40, 9)]
    all_lens = decode_lens + [c for c, _ in chunks]
    paged = make_paged(gen, all_lens, bs, kv_heads, head_dim, torch.float32)
    slots = [slots_of(paged, i, range(n - 1, n))[0] for i, n in enumerate(decode_lens)]
    qsl = [0]
    for j, (c, n) in enumerate(chunks):
        slots += slots_of(paged, len(decode_lens) + j, range(c - n, c))
        qsl.append(qsl[-1] + n)
    rows, nd = len(decode_lens) + qsl[-1], len(decode_lens)
    query = torch.randn(rows, kv_heads * group, head_dim, generator=gen)
    key = torch.randn(rows, kv_heads, head_dim, generator=gen)
    value = torch.randn(rows, kv_heads, head_dim, generator=gen)
    tables = paged.block_tables.to(device)
    ctx = [c for c, _ in chunks]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        num_decode_tokens=nd,
        decode_block_tables=tables[:nd],
        decode_seq_lens=torch.tensor(decode_lens, device=device),
        prefill_query_start_loc=qsl,
        prefill_seq_lens=ctx,
        prefill_block_tables=tables[nd:],
        prefill_query_start_loc_tensor=torch.tensor(qsl, device=device) if staged else None,
        prefill_seq_lens_tensor=torch.tensor(ctx, device=device) if staged else None,
    )
    return meta, paged.kv_layer.to(device), (query.to(device), key.to(device), value.to(device))


def _backend_mixed_step(tk: ModuleType, staged: bool) -> None:
    """Decode rows and prefill chunks in one step through the backend interface."""
    meta, kv_layer, (query, key, value) = mixed_step(torch.Generator().manual_seed(11),
                                                     staged=staged)
    ref_cache = kv_layer.clone()
    expected = TorchAttentionBackend().forward(query, key, value, ref_cache, meta, 0.125)
    actual = tk.TritonAttentionBackend().forward(query, key, value, kv_layer, meta, 0.125)
    assert torch.equal(kv_layer, ref_cache)
    close(actual, expected, torch.float32)


case("backend-mixed-step")(lambda tk: _backend_mixed_step(tk, staged=False))
case("backend-mixed-step-staged")(lambda tk: _backend_mixed_step(tk, staged=True))


@case("block-size-8-refused")
def _block_size_8_refused(tk: ModuleType) -> None:
    """A block of 8 would be a `tl.dot` dimension below 16: wrong on a GPU, though the
    interpreter would run it, so the kernels refuse it themselves."""
    gen = torch.Generator().manual_seed(4)
    paged = make_paged(gen, [20], block_size=8, kv_heads=1, head_dim=64, dtype=torch.float32)
    query = torch.randn(1, 2, 64, generator=gen)
    for launch in (
        lambda: tk.paged_decode_attention(query, paged.kv_layer, paged.block_tables,
                                          torch.tensor([20]), 0.125),
        lambda: tk.reshape_and_cache(query[:, :1], query[:, 1:], paged.kv_layer,
                                     torch.tensor([3])),
    ):
        try:
            launch()
        except ValueError as err:
            assert "block_size in 16/32/64/128, got 8" in str(err), err
        else:
            raise AssertionError("block_size 8 was not refused")


# -- the two halves: the child process runs the cases, pytest asserts their outcomes ---------


def run_all() -> dict[str, str | None]:
    tk = importlib.import_module(MODULE)
    assert tk.interpreting()
    return run_cases(CASES, tk)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str | None]:
    pytest.importorskip("triton")
    return outcomes_of(__file__)


@pytest.mark.processes
@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_matches_reference(outcomes, name):
    assert name in outcomes
    assert outcomes[name] is None, outcomes[name]


@pytest.mark.fast
def test_arguments_that_change_every_step_are_not_specialised():
    """Triton compiles a variant per value class (1, multiple of 16, other) of each
    specialised integer: the block table's width and the split sizes change with the batch,
    so specialising on them would compile new variants mid-serving."""
    pytest.importorskip("triton")
    tk = importlib.import_module(MODULE)
    unspecialised = {
        name: {p.name for p in getattr(tk, name).params if p.do_not_specialize}
        for name in ("_decode_kernel", "_decode_reduce_kernel", "_prefill_kernel")
    }
    assert unspecialised == {
        "_decode_kernel": {"bt_stride", "blocks_per_split", "num_splits"},
        "_decode_reduce_kernel": {"num_splits"},
        "_prefill_kernel": {"bt_stride"},
    }


@pytest.mark.fast
def test_this_process_stays_compiled():
    """The interpreter flag was given to the child only."""
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_kernels_on_cuda():
    """On a GPU, the same comparison with compiled kernels (in this process)."""
    tk = importlib.import_module(MODULE)
    assert not tk.interpreting()
    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(2, 64, 16, 2, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    tables = torch.randperm(64, device="cuda", generator=g)[:60].view(4, 15)
    lens = torch.tensor([1, 77, 200, 240], device="cuda")
    q = torch.randn(4, 16, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    for window in (0, 50, 7):  # full attention, sliding windows across and inside blocks
        ref = torch_ref.paged_decode_attention(q.float(), kv.float(), tables, lens, 0.1, window)
        for splits in (1, 4):
            out = tk.paged_decode_attention(q, kv, tables, lens, 0.1, num_splits=splits,
                                            window=window)
            torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("staged", [False, True], ids=["host-lists", "staged"])
def test_a_mixed_step_never_waits_for_the_device(staged: bool):
    """A step with decode rows and prompt chunks (the prefill offsets copied from the host
    lists, or staged by the input batch) launches without one host synchronisation, and
    matches the reference."""
    tk = importlib.import_module(MODULE)
    backend = tk.TritonAttentionBackend()
    meta, kv, (q, k, v) = mixed_step(torch.Generator().manual_seed(11), "cuda", staged)
    backend.forward(q, k, v, kv.clone(), meta, 0.125)  # compiles the kernels
    meta.step_cache.clear()  # the next step builds its prefill tensors again
    ref_cache = kv.clone()
    expected = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, 0.125)
    meta.step_cache.clear()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        actual = backend.forward(q, k, v, kv, meta, 0.125)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(kv, ref_cache)
    close(actual, expected, torch.float32)


if __name__ == "__main__":
    print(json.dumps(run_all()))
