"""The shape contract of a request's KV as it crosses processes.

A request's KV is `kv_cache[:, :, block_ids]`, shaped
`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`, of which `num_tokens`
tokens are valid (the last block may be partial). Both sides check every field against
this one description before touching a byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdmesh.kvstore.transfer.errors import KVHandleError

# Wire and proto codes; never renumber (they are part of the wire format, version 1).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
}
DTYPES_BY_CODE: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}

# Guards against absurd sizes from a corrupt or hostile peer before anything is allocated.
MAX_DIM = 1 << 20
MAX_PAYLOAD_BYTES = 1 << 40


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_tokens: int

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def of(cls, kv: torch.Tensor, num_tokens: int) -> KVLayout:
        """Describe a KV tensor cut from the engine cache."""
        if kv.dim() != 6 or kv.shape[1] != 2:
            raise KVHandleError(
                f"KV must be [layers, 2, blocks, block_size, kv_heads, head_dim], "
                f"got {tuple(kv.shape)}"
            )
        layers, _, blocks, block_size, heads, head_dim = (int(d) for d in kv.shape)
        return cls(layers, blocks, block_size, heads, head_dim, kv.dtype, int(num_tokens))

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (
            self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
            self.head_dim,
        )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    @property
    def dtype_code(self) -> int:
        return DTYPE_CODES[self.dtype]

    def validate(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise KVHandleError(f"unsupported KV dtype {self.dtype}")
        dims = {
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
        }
        for name, value in dims.items():
            if not isinstance(value, int) or not 0 < value <= MAX_DIM:
                raise KVHandleError(f"{name} must be in 1..{MAX_DIM}, got {value!r}")
        capacity = self.num_blocks * self.block_size
        if not capacity - self.block_size < self.num_tokens <= capacity:
            raise KVHandleError(
                f"num_tokens={self.num_tokens} does not fit {self.num_blocks} blocks of "
                f"{self.block_size} (the last block may be partial, no block may be empty)"
            )
        if self.nbytes > MAX_PAYLOAD_BYTES:
            raise KVHandleError(f"KV of {self.nbytes} bytes exceeds {MAX_PAYLOAD_BYTES}")

    def empty(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Allocate an uninitialised destination tensor of this layout."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def check_tensor(self, tensor: torch.Tensor) -> None:
        """Refuse a destination that would not hold exactly this KV, contiguously."""
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise KVHandleError(
                f"destination is {tuple(tensor.shape)} {tensor.dtype}, "
                f"expected {self.shape} {self.dtype}"
            )
        if not tensor.is_contiguous():
            raise KVHandleError("destination tensor must be contiguous")
