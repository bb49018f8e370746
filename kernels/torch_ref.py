"""Reference paged-attention ops in plain torch: the ground truth every other kernel is tested
against, and the CPU path of the engine.

Cache layout for one layer: `kv_layer[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 = K, 1 = V). A sequence's token `t` lives in block `block_table[t // block_size]` at
offset `t % block_size`; `slot = block * block_size + offset` is what `slot_mapping` holds.

`window` (every attention op's last argument; 0: full attention) is a sliding attention window
of that many tokens, as transformers masks it: the query at position p sees keys p - window + 1
.. p (Mistral v0.1, Qwen2's sliding layers, and the local layers of the models that mix both).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write `key/value[T, Hkv, D]` into the paged cache at `slot_mapping[T]`."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
    flat = kv_layer.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def gather_kv(
    kv_layer: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first `num_tokens` tokens as `[Hkv, num_tokens, D]`."""
    block_size = kv_layer.shape[2]
    num_blocks = -(-num_tokens // block_size)
    blocks = kv_layer[:, block_table[:num_blocks]]  # [2, nb, bs, H, D]
    kv = blocks.flatten(1, 2)[:, :num_tokens]  # [2, n, H, D]
    return kv[0].transpose(0, 1), kv[1].transpose(0, 1)


def first_visible(seq_lens: torch.Tensor, window: int) -> torch.Tensor:
    """The first key position the last token of each context sees (0 without a window)."""
    return (seq_lens - window).clamp(min=0) if window else torch.zeros_like(seq_lens)


def paged_decode_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """One query token per sequence against its paged context.

    query `[B, Hq, D]`, block_tables `[B, max_blocks]` (padding entries may hold any valid
    block id), seq_lens `[B]` (context length including the query token). Returns `[B, Hq, D]`.
    The `Hq / Hkv` query heads that share a KV head are laid out as that head's "query length",
    so grouped-query attention needs no repeat of K/V.
    """
    batch, num_q_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_layer.shape
    max_len = int(seq_lens.max())
    nb = -(-max_len // block_size)
    kv = kv_layer[:, block_tables[:, :nb]]  # [2, B, nb, bs, Hkv, D]
    kv = kv.flatten(2, 3)[:, :, :max_len].permute(0, 1, 3, 2, 4)  # [2, B, Hkv, L, D]
    group = num_q_heads // num_kv_heads
    q = query.view(batch, num_kv_heads, group, head_dim)
    positions = torch.arange(max_len, device=query.device)
    mask = ((positions[None, :] < seq_lens[:, None])
            & (positions[None, :] >= first_visible(seq_lens, window)[:, None]))
    mask = mask[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=scale)
    return out.reshape(batch, num_q_heads, head_dim)


def prefill_attention_one(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of `query[q, Hq, D]` against `key/value[Hkv, ctx, D]`, ctx >= q.

    The queries are the last `q` tokens of the context (a chunk of a prompt, possibly after a
    cached prefix), so query `i` sees keys `0 .. ctx - q + i` (with a window, the last
    `window` of them).
    """
    q_len, num_q_heads, _ = query.shape
    ctx = key.shape[1]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
    k, v = key.unsqueeze(0), value.unsqueeze(0)
    gqa = num_q_heads != key.shape[0]
    if ctx == q_len and (not window or ctx <= window):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        rows = torch.arange(q_len, device=query.device)[:, None] + (ctx - q_len)
        cols = torch.arange(ctx, device=query.device)[None, :]
        mask = (cols <= rows) & (cols > rows - window) if window else cols <= rows
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def prefill_chunks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    first_row: int,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    gather: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
    window: int = 0,
) -> None:
    """Attention of a step's prompt chunks (rows from `first_row` on) into `out`.

    A chunk with nothing cached before it attends to the step's fresh K/V directly; one after a
    cached prefix reads its context from the paged cache with `gather` (the backends differ
    only in how they gather).
    """
    for i, ctx in enumerate(seq_lens):
        start, end = first_row + query_start_loc[i], first_row + query_start_loc[i + 1]
        if ctx == end - start:
            k, v = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)
        else:
            k, v = gather(kv_layer, block_tables[i], ctx)
        out[start:end] = prefill_attention_one(query[start:end], k, v, scale, window)


def paged_prefill_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Queries of several sequences (concatenated, `[T, Hq, D]`) against their paged context.

    Sequence `i` owns query rows `query_start_loc[i]:query_start_loc[i+1]`, which are the
    last tokens of its `seq_lens[i]`-token context; its K/V (cached prefix included) must
    already be in the cache.
    """
    out = torch.empty_like(query)
    for i, ctx in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        k, v = gather_kv(kv_layer, block_tables[i], ctx)
        out[start:end] = prefill_attention_one(query[start:end], k, v, scale, window)
    return out
