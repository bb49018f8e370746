"""The attention backends' names (`--attention-backend`), torch-free: `EngineConfig` checks the
flag against them in processes that never import torch (`pdmesh serve`'s supervisor)."""

BACKEND_NAMES = ("flash-attn", "triton", "cpu", "torch")
