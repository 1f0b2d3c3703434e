"""The format-neutral quantized weight that quantizers produce and every packer consumes.

Keeping one canonical form means a quantizer never knows about on-disk layouts and a layout
never knows about quantizers: `formats/*` convert to and from this, nothing else.

Convention (GPTQ's, shared by AWQ and compressed-tensors once offsets are applied):
    W[n, k] = scales[n, g_idx[k]] * (qweight[n, k] - zeros[n, g_idx[k]])
with unsigned integer codes qweight in [0, 2**bits) and integer zeros in the same range.
Symmetric schemes use zeros == 2**(bits-1) everywhere.

`input_quant` (None for weight-only schemes) says how the linear's *input* is quantized at run time
(W8A8): int8 symmetric, {"strategy": "token", "dynamic": True} (scale = absmax/127 per token) or
{"strategy": "tensor", "dynamic": False, "scale": fp32 tensor [1]} (a calibrated static scale).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class QuantizedWeight:
    qweight: torch.Tensor  # uint8 [N, K], codes in [0, 2**bits)
    scales: torch.Tensor  # float32 [N, n_groups]; values already representable in the storage dtype
    zeros: torch.Tensor  # int32 [N, n_groups], in [0, 2**bits)
    g_idx: torch.Tensor  # int32 [K], group of each input column
    bits: int
    group_size: int  # -1 means one group per output channel
    sym: bool
    bias: Optional[torch.Tensor] = None
    # act-order bookkeeping: "none", "static" (groups contiguous, columns processed in Hessian
    # order) or "dynamic" (groups formed in processing order; g_idx is a real permutation map)
    act_order: str = "none"
    input_quant: Optional[dict] = None  # activation quantization (W8A8), see the module docstring

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    @property
    def n_groups(self) -> int:
        return self.scales.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Plain-torch dequantization: the oracle every packed path is tested against."""
        n, k = self.qweight.shape
        groups = self.scales.shape[1]
        gs = k if self.group_size == -1 else self.group_size
        if groups * gs == k and torch.equal(self.g_idx.long(), torch.arange(k, device=self.g_idx.device) // gs):
            # contiguous groups: broadcast per-group scale/zero instead of gathering [N, K] copies
            # (the same fp32 operations on the same values, so the same bits, at a fraction of the memory)
            s = self.scales.float().unsqueeze(2)
            z = self.zeros.float().unsqueeze(2)
            return ((self.qweight.reshape(n, groups, gs).float() - z) * s).reshape(n, k).to(dtype)
        g = self.g_idx.long()
        s = self.scales.float()[:, g]
        z = self.zeros.float()[:, g]
        return ((self.qweight.float() - z) * s).to(dtype)

    def signed_int8(self) -> torch.Tensor:
        """The codes as signed int8 [N, K] (q - 128) of an 8-bit symmetric weight: the layout of
        PyTorch's int8 kernels and of compressed-tensors' int-quantized weights. ValueError otherwise."""
        if self.bits != 8 or not bool((self.zeros == 128).all()):
            raise ValueError(f"signed int8 codes need an 8-bit weight with every zero at 128 (got {self.bits}-bit"
                             f"{'' if self.sym else ', asymmetric'})")
        return (self.qweight.to(torch.int16) - 128).to(torch.int8).contiguous()

    def has_trivial_g_idx(self) -> bool:
        k = self.qweight.shape[1]
        gs = k if self.group_size == -1 else self.group_size
        expected = torch.arange(k, dtype=torch.int32) // gs
        return bool(torch.equal(self.g_idx.to(torch.int32).cpu(), expected))
