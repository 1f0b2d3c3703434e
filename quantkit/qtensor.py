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

import math
from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.errors import QuantkitError


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

    def has_trivial_g_idx(self) -> bool:
        k = self.qweight.shape[1]
        gs = k if self.group_size == -1 else self.group_size
        expected = torch.arange(k, dtype=torch.int32) // gs
        return bool(torch.equal(self.g_idx.to(torch.int32).cpu(), expected))


ACT_ORDERS = ("none", "static", "dynamic")
INPUT_QUANTS = (None, "token", "tensor")  # weight-only, int8 dynamic per token, int8 static per tensor


@dataclass(frozen=True)
class LinearSpec:
    """The shape and scheme of one quantized linear, known before any tensor is read: what steps
    plan to produce (so a format can refuse it before calibration) and what loaders allocate from."""

    out_features: int
    in_features: int
    bits: int
    group_size: int = -1  # -1: one group spanning all input features (per output channel)
    sym: bool = True
    act_order: str = "none"  # "none" | "static" (trivial g_idx) | "dynamic" (real g_idx)
    input_quant: Optional[str] = None  # activation scheme (W8A8): None | "token" | "tensor"

    def __post_init__(self):
        if self.out_features <= 0 or self.in_features <= 0:
            raise QuantkitError(f"linear shape must be positive, got [{self.out_features}, {self.in_features}]")
        if not 1 <= self.bits <= 8:
            raise QuantkitError(f"bits must be in 1..8, got {self.bits}")
        if self.group_size != -1 and self.group_size <= 0:
            raise QuantkitError(f"group_size must be -1 (per channel) or positive, got {self.group_size}")
        if self.act_order not in ACT_ORDERS:
            raise QuantkitError(f"act_order must be one of {ACT_ORDERS}, got {self.act_order!r}")
        if self.input_quant not in INPUT_QUANTS:
            raise QuantkitError(f"input_quant must be one of {INPUT_QUANTS}, got {self.input_quant!r}")

    @property
    def effective_group_size(self) -> int:
        return self.in_features if self.group_size == -1 else self.group_size

    @property
    def n_groups(self) -> int:
        return math.ceil(self.in_features / self.effective_group_size)

    @property
    def max_code(self) -> int:
        return (1 << self.bits) - 1

    def trivial_g_idx(self) -> torch.Tensor:
        return torch.arange(self.in_features, dtype=torch.int32) // self.effective_group_size

    def scheme(self) -> tuple:
        """What must agree for two linears to share one config entry (shape excluded)."""
        return (self.bits, self.group_size, self.sym, self.act_order, self.input_quant)

    @classmethod
    def of(cls, qw: QuantizedWeight) -> "LinearSpec":
        n, k = qw.qweight.shape
        iq = qw.input_quant["strategy"] if qw.input_quant else None
        return cls(out_features=n, in_features=k, bits=qw.bits, group_size=qw.group_size,
                   sym=qw.sym, act_order=qw.act_order, input_quant=iq)
