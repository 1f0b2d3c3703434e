"""Two 4-bit codes per byte along the input dim: column 2j in the low nibble, column 2j+1 in the high one.

The order compressed-tensors' `pack_fp4_to_uint8` and vLLM's FP4 kernels read (NVFP4 and MXFP4 alike).
"""
from __future__ import annotations

import torch

from quantkit.errors import QuantkitError


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15, K even) -> uint8 [N, K/2]."""
    if codes.ndim != 2 or codes.shape[1] % 2:
        raise QuantkitError(f"FP4 packing needs a 2-D code tensor with an even number of columns, "
                            f"got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[:, 0::2] & 0xF) | ((c[:, 1::2] & 0xF) << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 codes [N, K]."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)
