"""The architecture facts of a checkpoint, read once from its config: which model types run,
the sizes and switches the forward needs (`ModelConfig`), each layer's sliding attention
window, and the RoPE variant's inverse frequencies. Pure reading: no module is built here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class MoeSpec:
    """The experts of a checkpoint: how many, how many a token uses, and their widths."""

    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's MLP width
    renormalize: bool  # the top-k weights rescaled to sum to one (Mixtral; Qwen's norm_topk_prob)
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead (Qwen's mlp_only_layers)

    @classmethod
    def from_hf(cls, hf: object, num_layers: int) -> MoeSpec | None:
        """The spec of a MoE config; None for a dense model type."""
        model_type = getattr(hf, "model_type", "")
        if model_type not in MOE_MODEL_TYPES:
            return None
        experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)
        top_k = getattr(hf, "num_experts_per_tok", None)
        if not experts or not top_k or not 0 < int(top_k) <= int(experts):
            raise ValueError(f"model: {model_type} needs num_experts_per_tok in 1..num_experts "
                             f"(got {top_k} of {experts})")
        if model_type == "mixtral":
            return cls(int(experts), int(top_k), int(hf.intermediate_size), renormalize=True)
        step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
        only_dense = set(getattr(hf, "mlp_only_layers", None) or ())
        dense = tuple(i for i in range(num_layers) if i in only_dense or (i + 1) % step)
        shared = getattr(hf, "shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" \
            else 0
        return cls(int(experts), int(top_k), int(hf.moe_intermediate_size),
                   renormalize=bool(getattr(hf, "norm_topk_prob", False)),
                   shared_intermediate_size=int(shared or 0), dense_layers=dense)

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @property
    def active_intermediate_size(self) -> int:
        """The MLP width one token's sparse layer computes (what its FLOPs scale with)."""
        return self.top_k * self.intermediate_size + self.shared_intermediate_size


DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
GEMMA_MODEL_TYPES = ("gemma3_text",)  # Gemma 3's language model (Gemma3ForCausalLM)
SUPPORTED_MODEL_TYPES = (*DENSE_MODEL_TYPES, *MOE_MODEL_TYPES, *GEMMA_MODEL_TYPES)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # SwiGLU; Gemma's GeGLU with tanh-approximate GELU
_QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")  # q/k/v always biased (Qwen2-MoE: `qkv_bias`)
_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")


MISTRAL_DEFAULT_SLIDING_WINDOW = 4096
"""transformers' MistralConfig default: a mistral config.json without `sliding_window` gets it."""


def sliding_window(hf: object) -> int | None:
    """The attention window a checkpoint's sliding layers use, or None for full attention:
    Mistral's `sliding_window` (v0.1: 4096; null from v0.2), Qwen2's only with
    `use_sliding_window`. Which layers slide: `layer_windows`."""
    model_type = getattr(hf, "model_type", "")
    default = MISTRAL_DEFAULT_SLIDING_WINDOW if model_type == "mistral" else None
    window = getattr(hf, "sliding_window", default)
    if not window or (model_type.startswith("qwen")
                      and not getattr(hf, "use_sliding_window", False)):
        return None
    return int(window)


def layer_windows(hf: object, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding attention window in tokens, 0 for full attention: the config's
    `layer_types` where it lists them (transformers fills them in), else Qwen's rule (layers
    from `max_window_layers` on slide), else every layer alike. The attention kernels mask
    keys outside the window (kernels/torch_ref.py), so the whole context is served."""
    window = sliding_window(hf)
    if not window:
        return (0,) * num_layers
    types = getattr(hf, "layer_types", None)
    if types:
        if len(types) != num_layers:
            raise ValueError(f"model: layer_types lists {len(types)} layers of {num_layers}")
        return tuple(window if kind == "sliding_attention" else 0 for kind in types)
    if getattr(hf, "model_type", "").startswith("qwen"):
        first = int(getattr(hf, "max_window_layers", 0) or 0)
        return tuple(window if i >= first else 0 for i in range(num_layers))
    return (window,) * num_layers


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the worker needs, read from a HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k, before RoPE
    moe: MoeSpec | None = None  # the experts of a mixture-of-experts model
    windows: tuple[int, ...] = ()  # each layer's sliding window (0: full); empty: all full
    hidden_act: str = "silu"  # the gated MLP's activation (ACTIVATIONS)
    # Gemma: embeddings scaled by sqrt(hidden), attention scaled by query_pre_attn_scalar, the
    # attention and MLP outputs normed before the residual add ("sandwich" norms), every norm
    # weight stored as an offset from 1, sliding layers on their own RoPE base, and logits
    # optionally soft-capped.
    embed_scale: float = 1.0
    attn_scale: float | None = None  # None: head_dim ** -0.5
    sandwich_norms: bool = False
    norm_offset: float = 0.0  # added to every RMSNorm weight at load
    local_rope_layers: tuple[bool, ...] = ()  # layers on the sliding-attention RoPE table
    final_logit_softcap: float | None = None

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    @property
    def moe_intermediate_size(self) -> int:
        return self.moe.intermediate_size if self.moe else 0

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.moe.shared_intermediate_size if self.moe else 0

    @property
    def active_intermediate_size(self) -> int:
        """The MLP width a token computes: a MoE token's experts', else the dense MLP's."""
        return self.moe.active_intermediate_size if self.moe else self.intermediate_size

    @classmethod
    def from_hf(cls, hf: object) -> ModelConfig:
        model_type = getattr(hf, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model: architecture {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"model: hidden_act {act!r} is not supported "
                             f"({' or '.join(ACTIVATIONS)})")
        if getattr(hf, "attn_logit_softcapping", None):
            raise ValueError("model: attention logit soft-capping is not supported")
        heads = hf.num_attention_heads
        qkv_bias = (bool(getattr(hf, "qkv_bias", True)) if model_type in _QKV_BIAS_TYPES
                    else bool(getattr(hf, "attention_bias", False)))
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=model_type in _QK_NORM_TYPES,
            moe=MoeSpec.from_hf(hf, hf.num_hidden_layers),
            windows=layer_windows(hf, hf.num_hidden_layers),
            hidden_act=act,
            **(_gemma_facts(hf) if model_type in GEMMA_MODEL_TYPES else {}),
        )


def _gemma_facts(hf: object) -> dict[str, object]:
    """What a Gemma 3 config changes from the Llama defaults (see `ModelConfig`)."""
    layer_types = tuple(getattr(hf, "layer_types", None) or ())
    return {
        "embed_scale": float(hf.hidden_size) ** 0.5,
        "attn_scale": float(getattr(hf, "query_pre_attn_scalar", None)
                            or getattr(hf, "head_dim", 256)) ** -0.5,
        "sandwich_norms": True,
        "norm_offset": 1.0,
        "local_rope_layers": (tuple(kind == "sliding_attention" for kind in layer_types)
                              if _rope_by_layer_type(hf) else ()),
        "final_logit_softcap": getattr(hf, "final_logit_softcapping", None) or None,
    }


def _rope_by_layer_type(hf: object) -> bool:
    """Whether the config's rope_parameters are keyed by layer type (Gemma 3: a local base
    for sliding layers, another, possibly scaled, for full ones)."""
    params = getattr(hf, "rope_parameters", None)
    return isinstance(params, dict) and "sliding_attention" in params


def rope_inv_freq(hf: object, head_dim: int,
                  layer_type: str = "full_attention") -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scaling for the config's RoPE variant (of `layer_type`
    where the config keys its RoPE by layer type).

    Scaled variants (linear, llama3, yarn, ...) come from transformers' own table so that
    we match the reference implementation exactly.
    """
    by_type = _rope_by_layer_type(hf)
    all_params = getattr(hf, "rope_parameters", None) or {}
    params = dict(all_params[layer_type] if by_type else all_params)
    rope_type = params.get("rope_type", "default")
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"model: partial RoPE (partial_rotary_factor {partial}) is not supported")
    if rope_type == "longrope":  # its factors switch with the sequence's length: not a table
        raise ValueError("model: longrope RoPE scaling is not supported")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv, 1.0
    if rope_type == "dynamic":
        raise ValueError("model: dynamic NTK RoPE scaling is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"model: RoPE type {rope_type!r} is not supported")
    kwargs = {"layer_type": layer_type} if by_type else {}
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, None, **kwargs)
    return inv.float(), float(scaling)
