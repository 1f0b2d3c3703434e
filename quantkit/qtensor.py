"""The format-neutral quantized weight that quantizers produce and every packer consumes.

Keeping one canonical form means a quantizer never knows about on-disk layouts and a layout
never knows about quantizers: `formats/*` convert to and from this, nothing else.

Convention (GPTQ's, shared by AWQ and compressed-tensors once offsets are applied):
    W[n, k] = scales[n, g_idx[k]] * (qweight[n, k] - zeros[n, g_idx[k]])
with unsigned integer codes qweight in [0, 2**bits) and integer zeros in the same range.
Symmetric schemes use zeros == 2**(bits-1) everywhere.
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

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    @property
    def n_groups(self) -> int:
        return self.scales.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Plain-torch dequantization: the oracle every packed path is tested against."""
        g = self.g_idx.long()
        s = self.scales.float()[:, g]
        z = self.zeros.float()[:, g]
        return ((self.qweight.float() - z) * s).to(dtype)

    def has_trivial_g_idx(self) -> bool:
        k = self.qweight.shape[1]
        gs = k if self.group_size == -1 else self.group_size
        expected = torch.arange(k, dtype=torch.int32) // gs
        return bool(torch.equal(self.g_idx.to(torch.int32).cpu(), expected))
