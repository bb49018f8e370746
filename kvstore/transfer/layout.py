"""The shape contract of a request's KV as it crosses processes.

A request's KV is `kv_cache[:, :, block_ids]`, shaped
`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`, of which `num_tokens`
tokens are valid (the last block may be partial). Both sides check every field against
this one description before touching a byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from pdmesh.kvstore.transfer.errors import KVHandleError

if TYPE_CHECKING:
    import torch

# Wire and proto codes; never renumber (they are part of the wire format, version 1).
DTYPE_NAMES_BY_CODE: dict[int, str] = {1: "float32", 2: "float16", 3: "bfloat16"}
"""The dtypes KV may cross processes in, by code, named as torch names them (torch-free: a
serving process checks codes and names without loading torch)."""
DTYPE_CODES_BY_NAME: dict[str, int] = {name: code for code, name in DTYPE_NAMES_BY_CODE.items()}
ITEMSIZES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}

_TABLES = ("DTYPE_CODES", "DTYPES_BY_CODE", "DTYPE_NAMES", "DTYPES_BY_NAME")


@cache
def _tables() -> dict[str, dict[Any, Any]]:
    """The torch-dtype tables, built on first use (that imports torch)."""
    import torch

    by_code = {code: getattr(torch, name) for code, name in DTYPE_NAMES_BY_CODE.items()}
    return {
        "DTYPE_CODES": {dtype: code for code, dtype in by_code.items()},
        "DTYPES_BY_CODE": by_code,
        "DTYPE_NAMES": {dtype: DTYPE_NAMES_BY_CODE[code] for code, dtype in by_code.items()},
        "DTYPES_BY_NAME": {DTYPE_NAMES_BY_CODE[code]: dtype for code, dtype in by_code.items()},
    }


def __getattr__(name: str) -> Any:
    """`DTYPE_CODES` (torch dtype → code), `DTYPES_BY_CODE`, `DTYPE_NAMES` (torch dtype →
    name), `DTYPES_BY_NAME`: the tables keyed or valued by torch dtypes, lazily."""
    if name in _TABLES:
        return _tables()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_by_name(name: str) -> torch.dtype:
    """The torch dtype of a whitelisted name (imports torch); KeyError for any other."""
    return _tables()["DTYPES_BY_NAME"][name]  # type: ignore[no-any-return]


def dtype_by_code(code: int) -> torch.dtype:
    """The torch dtype of a whitelisted wire code (imports torch); KeyError for any other."""
    return _tables()["DTYPES_BY_CODE"][code]  # type: ignore[no-any-return]


# Guards against absurd sizes from a corrupt or hostile peer before anything is allocated.
MAX_DIM = 1 << 20
MAX_PAYLOAD_BYTES = 1 << 40


def name_of_dtype(dtype: torch.dtype | str) -> str:
    """A dtype's name as torch spells it (`float32`), from a torch dtype or a name."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVLayout:
    """`dtype` is kept by name (`"float32"`): a layout is described, checked and sent without
    torch; a torch dtype given is kept by its name, and `torch_dtype` is the torch one."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", name_of_dtype(self.dtype))
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
        return ITEMSIZES[self.dtype]

    @property
    def dtype_name(self) -> str:
        return self.dtype

    @property
    def dtype_code(self) -> int:
        return DTYPE_CODES_BY_NAME[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype (imports torch: for the staged transports, which build tensors)."""
        return dtype_by_name(self.dtype)

    def validate(self) -> None:
        if self.dtype not in DTYPE_CODES_BY_NAME:
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
        import torch

        return torch.empty(self.shape, dtype=self.torch_dtype, device=device)

    def check_tensor(self, tensor: torch.Tensor) -> None:
        """Refuse a destination that would not hold exactly this KV, contiguously."""
        if tuple(tensor.shape) != self.shape or name_of_dtype(tensor.dtype) != self.dtype:
            raise KVHandleError(
                f"destination is {tuple(tensor.shape)} {tensor.dtype}, "
                f"expected {self.shape} {self.dtype}"
            )
        if not tensor.is_contiguous():
            raise KVHandleError("destination tensor must be contiguous")
