"""pdmesh: LLM serving with disaggregated prefill and decode over a gRPC mesh."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from pdmesh.engine.frontend.llm import LLM
    from pdmesh.engine.outputs import CompletionOutput, RequestOutput
    from pdmesh.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy so that `import pdmesh.v1...` in a thin gRPC client does not import torch.
    if name == "LLM":
        from pdmesh.engine.frontend.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from pdmesh.engine import outputs

        return getattr(outputs, name)
    if name == "SamplingParams":
        from pdmesh.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdmesh' has no attribute {name!r}")
