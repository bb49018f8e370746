"""Paged-attention kernels in Triton: the CUDA path when flash-attn is absent.

Three kernels over the cache layout of `torch_ref` (`kv_layer[2, num_blocks, block_size,
num_kv_heads, head_dim]`, contiguous):

- `reshape_and_cache`: one program per token copies its K and V rows to `slot_mapping[t]`
  (a negative slot means "padding, skip").
- `paged_decode_attention`: one query token per sequence. A program owns one (sequence, KV
  head, split): all query heads that share the KV head are processed together, so each K/V
  tile is read once per group, not once per query head. Long contexts are cut into `num_splits`
  ranges of blocks that run in parallel and write a partial result (unnormalised output, row
  max, row sum); a second small kernel merges them. With one split the first kernel writes the
  final output directly.
- `paged_prefill_attention`: chunks of prompt queries. A program owns one (sequence, query
  head, tile of query rows); it first attends to the sequence's cached prefix through the block
  table (every prefix token is visible to every query), then causally to the chunk's own K/V,
  read from the step's contiguous `key`/`value` rows.

A KV block is a `tl.dot` dimension, so the kernels take only the block sizes
`backend.BLOCK_SIZES["triton"]` names (backend selection refuses the others at start-up).
Arguments that change from step to step (the block table's row stride, the split sizes) are
`do_not_specialize`: Triton would otherwise compile another variant mid-serving each time one
of them happens to be 1 or a multiple of 16.

All three use online softmax in base 2 with float32 accumulation. They run on CPU under
`TRITON_INTERPRET=1`, which is how the tests check them against `torch_ref`. Triton reads
that flag when `triton` itself is imported (its library functions are `@triton.jit` too) and
again while kernels run, so it must be in the environment before the first `import triton`.
"""

from __future__ import annotations

import itertools
import math

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from pdmesh.kernels.backend import BLOCK_SIZES, AttentionMetadata, block_size_unsupported_reason

_LOG2E = 1.0 / math.log(2.0)
_MIN_DOT = 16  # tl.dot needs every dimension >= 16


def interpreting() -> bool:
    """True when this module's kernels were built for the Triton CPU interpreter."""
    return not isinstance(_reshape_and_cache_kernel, JITFunction)


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 stays exact (no TF32) so results match the float32 reference.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_cache(kv_layer: torch.Tensor) -> tuple[int, int, int, int]:
    if kv_layer.dim() != 5 or kv_layer.shape[0] != 2 or not kv_layer.is_contiguous():
        raise ValueError("kv_layer must be a contiguous [2, blocks, block_size, kv_heads, dim]")
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
    why_not = block_size_unsupported_reason("triton", block_size)
    if why_not is not None:
        raise ValueError(why_not)
    return num_blocks, block_size, num_kv_heads, head_dim


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x[T, H, D]` with unit stride on D and H packed densely (a row view of a fused GEMM
    output qualifies); copies only when that is not so."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def _output(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape != query.shape or out.stride(2) != 1:
        raise ValueError("out must have the query's shape and unit stride on head_dim")
    return out


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """`a @ b` with float32 accumulation. UPCAST (interpreter only) multiplies in float32:
    the interpreter's 16-bit `tl.dot` is wrong, while a bf16 x bf16 product is exact in
    float32 anyway, so the result matches what the GPU computes."""
    if UPCAST:
        res = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        res = tl.dot(a, b, input_precision=PRECISION)
    return res


# -- reshape_and_cache ------------------------------------------------------------------------


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    key_stride,
    value_stride,
    v_offset,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    ROW_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, ROW_PAD)
    mask = offs < ROW
    k = tl.load(key_ptr + t * key_stride + offs, mask=mask)
    v = tl.load(value_ptr + t * value_stride + offs, mask=mask)
    tl.store(cache_ptr + slot * ROW + offs, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + v_offset + slot * ROW + offs, v.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write `key/value[T, Hkv, D]` into the paged cache at `slot_mapping[T]` (< 0: skip)."""
    num_blocks, block_size, num_kv_heads, head_dim = _check_cache(kv_layer)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    key, value = _rows(key), _rows(value)
    row = num_kv_heads * head_dim
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_layer,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        num_blocks * block_size * row,
        ROW=row,
        ROW_PAD=_pow2(row),
    )


# -- decode -----------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["bt_stride", "blocks_per_split", "num_splits"])
def _decode_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale_log2,
    q_stride_b,
    q_stride_h,
    o_stride_b,
    o_stride_h,
    bt_stride,
    v_offset,
    blocks_per_split,
    num_splits,
    window,  # tokens each query sees (NO_WINDOW: all)
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write the normalised output, skip the partials
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    n = tl.arange(0, BLOCK_SIZE)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    # A sliding window: tokens before `first_tok` are masked and their blocks never read, so
    # every block the loop reads holds a visible token (no row of a block is all -inf), and a
    # split wholly before the window reads nothing (the reduce gives it weight 0).
    first_tok = tl.maximum(seq_len - window, 0)
    first_block = tl.maximum(split * blocks_per_split, first_tok // BLOCK_SIZE)
    end_block = tl.minimum(split * blocks_per_split + blocks_per_split,
                           tl.cdiv(seq_len, BLOCK_SIZE))
    row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for blk in range(first_block, end_block):
        block_id = tl.load(block_tables_ptr + seq * bt_stride + blk).to(tl.int64)
        tok = blk * BLOCK_SIZE + n
        tok_mask = (tok < seq_len) & (tok >= first_tok)
        offs = (block_id * BLOCK_SIZE + n)[:, None] * (NUM_KV_HEADS * HEAD_DIM)
        offs += kv_head * HEAD_DIM + d[None, :]
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(cache_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + v_offset + offs, mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * scale_log2
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1))
        p = tl.exp2(s - new_max[:, None])
        alpha = tl.exp2(row_max - new_max)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        row_max = new_max

    if DIRECT:
        out = acc / row_sum[:, None]
        tl.store(
            out_ptr + seq * o_stride_b + heads[:, None] * o_stride_h + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        part = (seq * NUM_Q_HEADS + heads) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_max_ptr + part, row_max, mask=g_mask)
        tl.store(part_sum_ptr + part, row_sum, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    o_stride_b,
    o_stride_h,
    num_splits,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    s_mask = s < num_splits
    part = (seq * NUM_Q_HEADS + head) * num_splits + s
    maxes = tl.load(part_max_ptr + part, mask=s_mask, other=float("-inf"))
    sums = tl.load(part_sum_ptr + part, mask=s_mask, other=0.0)
    top = tl.max(maxes, 0)
    # Splits past the end of a short sequence hold max = -inf and contribute weight 0.
    weight = tl.where(maxes > float("-inf"), tl.exp2(maxes - top), 0.0)
    total = tl.sum(sums * weight, 0)
    acc = tl.load(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], mask=s_mask[:, None])
    out = tl.sum(acc * weight[:, None], 0) / total
    tl.store(
        out_ptr + seq * o_stride_b + head * o_stride_h + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


NO_WINDOW = 1 << 30
"""The kernels' `window` for full attention: wider than any context (positions are int32)."""


def default_num_splits(batch: int, num_kv_heads: int, max_blocks: int) -> int:
    """Enough (sequence, KV head, split) programs to fill a large GPU (~256), but never a split
    shorter than 8 blocks: past that the merge costs more than the parallelism brings."""
    wanted = -(-256 // max(1, batch * num_kv_heads))
    return max(1, min(wanted, max_blocks // 8))


def paged_decode_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """One query token per sequence against its paged context (see `torch_ref`; `window`:
    a sliding window of that many tokens, 0 for none).

    query `[B, Hq, D]`, block_tables `[B, max_blocks]`, seq_lens `[B]` (including the query
    token, each >= 1). `num_splits` ranges of blocks per sequence run in parallel; the default
    comes from `default_num_splits`. Returns `out` (`[B, Hq, D]`, allocated when None).
    """
    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = _check_cache(kv_layer)
    out = _output(query, out)
    if batch == 0:
        return out
    max_blocks = block_tables.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, max_blocks)
    num_splits = max(1, min(num_splits, max_blocks))
    blocks_per_split = -(-max_blocks // num_splits)
    num_splits = -(-max_blocks // blocks_per_split)  # no split left without blocks
    group = num_q_heads // num_kv_heads
    dim_pad = _pow2(head_dim, _MIN_DOT)
    direct = num_splits == 1
    if direct:
        part_acc = part_max = part_sum = out  # unused by the kernel
    else:
        rows = batch * num_q_heads * num_splits
        part_acc = torch.empty((rows, dim_pad), dtype=torch.float32, device=query.device)
        part_max = torch.empty((rows,), dtype=torch.float32, device=query.device)
        part_sum = torch.empty((rows,), dtype=torch.float32, device=query.device)
    query = _rows(query)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query,
        kv_layer,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_max,
        part_sum,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        kv_layer[0].numel(),
        blocks_per_split,
        num_splits,
        window or NO_WINDOW,
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=_pow2(group, _MIN_DOT),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        DIRECT=direct,
        PRECISION=_dot_precision(query.dtype),
        UPCAST=interpreting(),
    )
    if not direct:
        _decode_reduce_kernel[(batch, num_q_heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            out.stride(0),
            out.stride(1),
            num_splits,
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            SPLITS_PAD=_pow2(num_splits),
        )
    return out


# -- prefill / extend -------------------------------------------------------------------------


@triton.jit(do_not_specialize=["bt_stride"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    v_stride_t,
    o_stride_t,
    o_stride_h,
    bt_stride,
    v_offset,
    window,  # tokens each query sees (NO_WINDOW: all)
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int64) - q_start
    if tile * BLOCK_M >= q_len:
        return
    prefix = tl.load(seq_lens_ptr + seq).to(tl.int64) - q_len
    kv_head = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, DIM_PAD)
    n = tl.arange(0, BLOCK_SIZE)
    row_mask = rows < q_len
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * q_stride_t + head * q_stride_h + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)

    # Row r (position prefix + r) sees positions > prefix + r - window. With a window a row
    # may see nothing of a tile yet, so the running max is taken as 0 while it is -inf (its
    # terms are then exp2(-inf) = 0, never exp2(-inf - -inf) = nan).
    # 1. The cached prefix, block by block through the block table, from the first block the
    # tile's first row sees.
    row_pos = prefix + rows
    lowest = tl.maximum(prefix + tile * BLOCK_M - window + 1, 0)
    for blk in range(lowest // BLOCK_SIZE, tl.cdiv(prefix, BLOCK_SIZE)):
        block_id = tl.load(block_tables_ptr + seq * bt_stride + blk).to(tl.int64)
        tok = blk * BLOCK_SIZE + n
        tok_mask = tok < prefix
        offs = (block_id * BLOCK_SIZE + n)[:, None] * (NUM_KV_HEADS * HEAD_DIM)
        offs += kv_head * HEAD_DIM + d[None, :]
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(cache_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + v_offset + offs, mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * scale_log2
        visible = tok_mask[None, :] & (tok[None, :] > row_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(s - safe_max[:, None])
        alpha = tl.exp2(row_max - safe_max)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        row_max = new_max

    # 2. The chunk itself, causally, from the step's contiguous K/V rows, from the first
    # column the tile's first row sees. Every row sees itself, so its sum ends above 0.
    c = tl.arange(0, BLOCK_N)
    causal_end = tl.minimum(q_len, (tile + 1) * BLOCK_M)
    first_col = tl.maximum(tile * BLOCK_M - window + 1, 0)
    for start in range((first_col // BLOCK_N) * BLOCK_N, causal_end, BLOCK_N):
        cols = start + c
        col_mask = cols < q_len
        kv_mask = col_mask[:, None] & d_mask[None, :]
        base = (q_start + cols)[:, None]
        k = tl.load(k_ptr + base * k_stride_t + kv_head * HEAD_DIM + d[None, :], mask=kv_mask)
        v = tl.load(v_ptr + base * v_stride_t + kv_head * HEAD_DIM + d[None, :], mask=kv_mask)
        k = tl.where(kv_mask, k, 0.0).to(q.dtype)
        v = tl.where(kv_mask, v, 0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * scale_log2
        visible = ((cols[None, :] <= rows[:, None]) & (cols[None, :] > rows[:, None] - window)
                   & col_mask[None, :])
        s = tl.where(visible, s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(s - safe_max[:, None])
        alpha = tl.exp2(row_max - safe_max)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        row_max = new_max

    out = acc / row_sum[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * o_stride_t + head * o_stride_h + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Prompt chunks of several sequences against cached prefix + their own causal part
    (`window`: a sliding window of that many tokens, 0 for none).

    query `[T, Hq, D]` and key/value `[T, Hkv, D]` are the chunks' rows, concatenated;
    sequence `i` owns rows `query_start_loc[i]:query_start_loc[i+1]` (a device tensor), which
    are the last tokens of its `seq_lens[i]`-token context. Its prefix (tokens before the
    chunk) is read from the cache via `block_tables[i]`; the chunk's K/V need not be cached.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = _check_cache(kv_layer)
    out = _output(query, out)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if block_m is None:
        block_m = 16 if interpreting() else 64
    query, key, value = _rows(query), _rows(key), _rows(value)
    grid = (num_seqs, num_q_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        query,
        key,
        value,
        kv_layer,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        value.stride(0),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        kv_layer[0].numel(),
        window or NO_WINDOW,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        DIM_PAD=_pow2(head_dim, _MIN_DOT),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_m,
        PRECISION=_dot_precision(query.dtype),
        UPCAST=interpreting(),
    )
    return out


# -- the backend --------------------------------------------------------------------------------


def _max_query_len(meta: AttentionMetadata) -> int:
    """The longest prompt chunk of the step (the prefill grid's height), once per step."""
    qsl = meta.prefill_query_start_loc
    return meta.cached(  # type: ignore[return-value]
        "triton.max_query_len",
        lambda: max((b - a for a, b in itertools.pairwise(qsl)), default=0),
    )


class TritonAttentionBackend:
    """Cache write, decode rows and prefill chunks, each one kernel launch per layer.

    `num_splits`: the decode kernel's parallel ranges per sequence; None picks them from the
    step's block-table width (`default_num_splits`). A CUDA graph fixes them at capture
    (engine/worker/cuda_graphs.py plans them per graph)."""

    name = "triton"
    block_sizes = BLOCK_SIZES["triton"]

    def __init__(self, num_splits: int | None = None) -> None:
        self.num_splits = num_splits

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        reshape_and_cache(key, value, kv_layer, meta.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        nd = meta.num_decode_tokens
        if nd:
            paged_decode_attention(
                query[:nd],
                kv_layer,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                scale,
                num_splits=self.num_splits,
                out=out[:nd],
                window=window,
            )
        if meta.num_prefills:
            query_start_loc, seq_lens = meta.prefill_tensors(query.device)
            paged_prefill_attention(
                query[nd:],
                key[nd:],
                value[nd:],
                kv_layer,
                meta.prefill_block_tables,
                query_start_loc,
                seq_lens,
                _max_query_len(meta),
                scale,
                out=out[nd:],
                window=window,
            )
        return out


__all__ = [
    "TritonAttentionBackend",
    "default_num_splits",
    "interpreting",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
]
