"""Which slice of the model each tensor-parallel rank holds: pure arithmetic, no torch.

Megatron's split, as vLLM does it: attention by heads (a rank holds whole query heads and the
KV heads they read, so attention never talks to another rank), the MLP by intermediate
columns (every expert of a MoE layer, and its shared expert, by its own intermediate columns),
embedding and LM head by vocabulary rows. Spans are contiguous and as even as they
can be: where the KV heads do not divide by the ranks (SmolLM2-135M: 3 KV heads, 9 query
heads) the first ranks hold one KV head more, each with its whole query group, so the model
still runs at any size up to its KV heads. Fewer KV heads than ranks: each KV head is
replicated on `world_size / num_kv_heads` consecutive ranks, which split its query group
(that needs the ranks to be a multiple of the KV heads and to divide the query heads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class ModelShape(Protocol):
    """The sizes sharding reads (engine/worker/models/llama.py's `ModelConfig`)."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def moe_intermediate_size(self) -> int: ...  # one expert's MLP width; 0: dense
    @property
    def shared_expert_intermediate_size(self) -> int: ...  # 0: no shared expert


@dataclass(frozen=True)
class Span:
    """`size` consecutive indices from `start`."""

    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size

    def scaled(self, factor: int) -> Span:
        """The same span in units `factor` times smaller (heads -> rows of a projection)."""
        return Span(self.start * factor, self.size * factor)


def split(total: int, parts: int, index: int) -> Span:
    """Part `index` of `total` split into `parts` contiguous spans, the first
    `total % parts` one larger than the rest."""
    base, extra = divmod(total, parts)
    return Span(index * base + min(index, extra), base + (1 if index < extra else 0))


def widths(total: int, parts: int) -> list[int]:
    """The size of every part of `split(total, parts, ...)`."""
    return [split(total, parts, i).size for i in range(parts)]


def check_shardable(shape: ModelShape, world_size: int) -> None:
    """ValueError, naming the sizes, when the model cannot be split over `world_size` ranks."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    widths_split = (shape.intermediate_size, shape.vocab_size, shape.moe_intermediate_size,
                    shape.shared_expert_intermediate_size)
    if any(0 < size < world_size for size in widths_split):
        raise ValueError(f"tensor_parallel_size={world_size} exceeds the model's MLP, expert or "
                         "vocabulary size")
    heads, kv = shape.num_heads, shape.num_kv_heads
    if world_size <= kv:
        return
    if world_size % kv or heads % world_size:
        fits = ", ".join(map(str, sizes_for(shape)))
        raise ValueError(
            f"tensor_parallel_size={world_size} cannot split this model: it has {kv} KV heads "
            f"and {heads} query heads; more ranks than KV heads needs a multiple of the KV "
            f"heads that divides the query heads (sizes that fit: {fits})")


def sizes_for(shape: ModelShape, limit: int = 64) -> list[int]:
    """The tensor-parallel sizes up to `limit` this model can be split over."""
    kv, heads = shape.num_kv_heads, shape.num_heads
    return [n for n in range(1, limit + 1) if n <= kv or (n % kv == 0 and heads % n == 0)]


@dataclass(frozen=True)
class ModelShard:
    """What one rank holds: its query heads, KV heads, MLP (expert, shared-expert) columns and
    vocabulary rows."""

    rank: int
    world_size: int
    head_dim: int
    q_heads: Span
    kv_heads: Span
    intermediate: Span
    vocab: Span
    vocab_widths: tuple[int, ...]  # every rank's vocabulary rows, for gathering logits
    moe_intermediate: Span = Span(0, 0)  # every expert's columns (a MoE model)
    shared_intermediate: Span = Span(0, 0)  # the shared expert's columns (Qwen2-MoE)

    @classmethod
    def of(cls, shape: ModelShape, rank: int, world_size: int) -> ModelShard:
        check_shardable(shape, world_size)
        heads, kv = shape.num_heads, shape.num_kv_heads
        group = heads // kv  # query heads per KV head
        if world_size <= kv:
            kv_heads = split(kv, world_size, rank)
            q_heads = kv_heads.scaled(group)
        else:  # replicated: `replicas` consecutive ranks share one KV head
            replicas = world_size // kv
            kv_heads = Span(rank // replicas, 1)
            q_heads = split(heads, world_size, rank)
        return cls(rank, world_size, shape.head_dim, q_heads, kv_heads,
                   split(shape.intermediate_size, world_size, rank),
                   split(shape.vocab_size, world_size, rank),
                   tuple(widths(shape.vocab_size, world_size)),
                   split(shape.moe_intermediate_size, world_size, rank),
                   split(shape.shared_expert_intermediate_size, world_size, rank))

    @classmethod
    def whole(cls, shape: ModelShape) -> ModelShard:
        """The shard of a single rank: everything."""
        return cls.of(shape, 0, 1)

    @property
    def is_whole(self) -> bool:
        return self.world_size == 1

    def checkpoint_slice(self, name: str) -> tuple[int, Span] | None:
        """The dimension and span this rank reads of checkpoint tensor `name` (our names:
        no `model.` prefix, q/k/v and gate/up still apart, one expert's tensors apart:
        `mlp.experts.<e>.gate_proj.weight`); None: the whole tensor."""
        hd = self.head_dim
        columns = (self.moe_intermediate if ".experts." in name
                   else self.shared_intermediate if ".shared_expert." in name
                   else self.intermediate)
        part = name.rsplit(".", 2)[-2]
        is_weight = name.endswith(".weight")
        if part == "q_proj":
            return 0, self.q_heads.scaled(hd)
        if part in ("k_proj", "v_proj"):
            return 0, self.kv_heads.scaled(hd)
        if part in ("gate_proj", "up_proj"):
            return 0, columns
        if part == "o_proj" and is_weight:
            return 1, self.q_heads.scaled(hd)
        if part == "down_proj" and is_weight:
            return 1, columns
        if part in ("embed_tokens", "lm_head"):
            return 0, self.vocab
        return None

    def keeps_whole_bias(self, name: str) -> bool:
        """A row-parallel projection's bias is added once, after the all-reduce: on the
        first rank only (the others hold zeros)."""
        return not name.endswith(("down_proj.bias", "o_proj.bias")) or self.rank == 0
