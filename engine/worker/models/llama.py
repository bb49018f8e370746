"""Llama-family decoder (Llama, Mistral, SmolLM, Qwen2, Qwen3, Phi-3/Phi-4, Gemma 3 and the
mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE) running on the paged KV cache. What differs
between them is read once from the config (engine/worker/models/architecture.py).

Our own forward, not transformers': tokens of many sequences are flattened into one `[T]`
batch (no padding), projections run as single GEMMs over all tokens, and attention goes
through a pluggable paged-attention backend. Q/K/V and gate/up are fused at load time so a
layer costs four GEMMs; everything between them goes through the fused layer ops
(kernels/layer_ops.py: add+RMSNorm, in-place RoPE, SiLU-and-mul), Triton kernels on CUDA.

With tensor parallelism each rank builds the model of its `ModelShard`
(engine/worker/parallel/sharding.py): QKV and gate/up hold this rank's heads and MLP columns
(column-parallel), o_proj and down_proj the matching input columns (row-parallel, one
all-reduce each), embedding and LM head a span of the vocabulary (engine/worker/parallel/vocab.py).
A single rank's shard is the whole model and its collectives are no-ops. A MoE layer's MLP is
engine/worker/models/moe.py's `SparseMoe`, split the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdmesh.engine.worker.models.architecture import ModelConfig
from pdmesh.engine.worker.models.moe import SparseMoe
from pdmesh.engine.worker.models.packed_linear import PackedLinear
from pdmesh.engine.worker.parallel.group import SINGLE, TensorParallel
from pdmesh.engine.worker.parallel.sharding import ModelShard
from pdmesh.engine.worker.parallel.vocab import embed, gather_logits
from pdmesh.kernels.backend import AttentionBackend, AttentionMetadata
from pdmesh.kernels.layer_ops import LayerOps, TorchLayerOps


class RotaryEmbedding(nn.Module):
    """cos/sin tables `[max_positions, D/2]` (NeoX / rotate-half layout), indexed per token.

    A step looks its positions up once (`lookup`) and every layer reuses the result: the
    lookup used to run once per layer, ~2 % of a decode step.
    """

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, D/2]` of the step's positions, in the model's dtype."""
        return (self.cos.index_select(0, positions).to(dtype),
                self.sin.index_select(0, positions).to(dtype))


def pack_linears(model: LlamaForCausalLM) -> None:
    """Swap every `nn.Linear` (projections, MoE routers, the LM head) for a `PackedLinear`
    (CPU, float32). Experts are 3-D weights, multiplied by `moe.grouped_linear`."""
    if isinstance(model.lm_head, PackedLinear):
        return  # already packed (a second runner over the same model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))


class RMSNorm(nn.Module):
    """The weight and epsilon of one norm; the model applies it through its `LayerOps`."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ModelShard, tp: TensorParallel,
                 window: int = 0) -> None:
        super().__init__()
        self.window = window  # a sliding window in tokens; 0: full attention
        self.num_heads, self.num_kv_heads, self.head_dim = (
            shard.q_heads.size,
            shard.kv_heads.size,
            cfg.head_dim,
        )
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.tp = tp
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        # Qwen3's per-head norms (one weight of head_dim, the same on every rank).
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        ops: LayerOps,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self._head_norm(q, self.q_norm, ops)
            k = self._head_norm(k, self.k_norm, ops)
        ops.rope_(q, k, *cos_sin)  # in place (inside the QKV output, without QK norms)
        out = backend.forward(q, k, v, kv_layer, meta, self.scale, self.window)
        return self.tp.all_reduce(self.o_proj(out.reshape(t, self.q_size)))

    def _head_norm(self, x: torch.Tensor, norm: RMSNorm, ops: LayerOps) -> torch.Tensor:
        """`x` `[T, H, D]` normalised over each head's D (a new, contiguous tensor)."""
        rows = x.reshape(-1, self.head_dim)
        return ops.rms_norm(rows, norm.weight, norm.eps).view(x.shape)


class MLP(nn.Module):
    """Gated MLP of `intermediate` columns (this rank's): SwiGLU, or Gemma's GeGLU (tanh
    GELU); also Qwen2-MoE's shared expert."""

    def __init__(self, cfg: ModelConfig, intermediate: int, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * intermediate, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(intermediate, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.tp = tp

    def partial(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """This rank's share of the output (to be all-reduced)."""
        gate_up = self.gate_up_proj(x)
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(ops.silu_and_mul(gate_up))

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(x, ops))


def layer_mlp(cfg: ModelConfig, shard: ModelShard, tp: TensorParallel,
              layer: int) -> nn.Module:
    """Layer `layer`'s MLP: experts where the model is sparse there, else dense."""
    if cfg.moe is None or not cfg.moe.is_sparse(layer):
        return MLP(cfg, shard.intermediate.size, tp)
    shared = (MLP(cfg, shard.shared_intermediate.size, tp)
              if cfg.moe.shared_intermediate_size else None)
    return SparseMoe(cfg.hidden_size, cfg.moe, shard.moe_intermediate.size, shared, tp)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ModelShard, tp: TensorParallel,
                 index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard, tp, cfg.window(index))
        # Llama: the MLP's input norm. Gemma: the attention output's, before the residual add;
        # its MLP's input and output norms are the two feed-forward ones.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = (RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
                                          if cfg.sandwich_norms else None)
        self.post_feedforward_layernorm = (RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
                                           if cfg.sandwich_norms else None)
        self.mlp = layer_mlp(cfg, shard, tp, index)
        self.local_rope = bool(cfg.local_rope_layers and cfg.local_rope_layers[index])


class LlamaForCausalLM(nn.Module):
    """Decoder stack + LM head. `forward` returns final hidden states of every step token.

    `shard`/`tp`: the slice this rank holds and its group (tensor parallelism); by default
    the whole model on one rank."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding | None,
                 shard: ModelShard | None = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.shard = shard if shard is not None else ModelShard.whole(cfg)
        self.tp = tp
        vocab = self.shard.vocab.size
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.shard, tp, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = rope
        self.local_rope: RotaryEmbedding | None = None  # Gemma's sliding layers' own table
        self.ops: LayerOps = TorchLayerOps()  # the model runner picks the device's best
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        assert self.rope is not None, "the loader sets the model's RoPE tables"
        # The residual stream, updated in place.
        residual = embed(self.embed_tokens.weight, input_ids, self.shard.vocab, self.tp)
        if self.cfg.embed_scale != 1.0:  # Gemma: sqrt(hidden), rounded to the weights' dtype
            # (a Python number: nothing for a captured CUDA graph to read from the host)
            residual = residual * float(torch.tensor(self.cfg.embed_scale, dtype=residual.dtype))
        cos_sin = self.rope.lookup(positions, residual.dtype)
        local = (self.local_rope.lookup(positions, residual.dtype)
                 if self.local_rope is not None else cos_sin)
        out: torch.Tensor | None = None  # the last block's output, not yet added
        for i, layer in enumerate(self.layers):
            x = self._add_norm(out, residual, layer.input_layernorm)
            out = layer.self_attn(x, local if layer.local_rope else cos_sin, kv_cache[i], meta,
                                  backend, self.ops)
            if layer.pre_feedforward_layernorm is None:
                x = self._add_norm(out, residual, layer.post_attention_layernorm)
                out = layer.mlp(x, self.ops)
                continue
            out = self._norm(out, layer.post_attention_layernorm)
            x = self._add_norm(out, residual, layer.pre_feedforward_layernorm)
            out = self._norm(layer.mlp(x, self.ops), layer.post_feedforward_layernorm)
        return self._add_norm(out, residual, self.norm)

    def _norm(self, x: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        assert norm is not None
        return self.ops.rms_norm(x, norm.weight, norm.eps)

    def _add_norm(
        self, out: torch.Tensor | None, residual: torch.Tensor, norm: RMSNorm
    ) -> torch.Tensor:
        """Add the previous block's output to the residual stream, then normalise it."""
        if out is None:
            return self.ops.rms_norm(residual, norm.weight, norm.eps)
        return self.ops.add_rms_norm(out, residual, norm.weight, norm.eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits `[rows, vocab]` (with tensor parallelism: on the first rank; the
        others get their own vocabulary columns)."""
        logits = gather_logits(self.lm_head(hidden).float(), self.shard.vocab_widths, self.tp)
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
