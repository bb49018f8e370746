"""Host memory the engine reserves but may never touch: the KV cache.

`torch.zeros` writes every byte, so a CPU engine's whole KV budget (1 GiB by default) was
resident from start-up, idle or not. An anonymous `mmap` is zero-filled by the kernel and
committed page by page as blocks are first written, so an idle engine holds only the KV it has
used, with the same all-zero contents. GPU memory has no such lazy commit (and is not host
RSS): it keeps `torch.zeros`.
"""

from __future__ import annotations

import math
import mmap

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose host pages are committed on first write (CPU), else torch.zeros."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes)  # anonymous, private, zero-filled by the kernel
    # frombuffer keeps `buffer` alive for as long as the tensor (or a view of it) lives.
    return torch.frombuffer(buffer, dtype=dtype).view(shape)
