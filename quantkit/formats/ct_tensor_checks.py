"""Shape and dtype checks for tensors read from a compressed-tensors float checkpoint (untrusted input)."""
from __future__ import annotations

import torch

from quantkit.errors import QuantkitError


def take(tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype, shape: tuple[int, ...],
         layout: str) -> torch.Tensor:
    """tensors[name], refused in one line unless it has exactly this dtype and shape."""
    if name not in tensors:
        raise QuantkitError(f"{layout} layer lacks {name}; the checkpoint is incomplete, re-export it")
    t = tensors[name]
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise QuantkitError(f"{layout} {name} is {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)}; "
                            "the checkpoint does not match its quantization_config")
    return t
