"""`LinearSpec`: the shape and scheme of one quantized linear, known before any tensor is read.

Loaders need it to allocate buffers (``packed_shapes``) and to validate what a checkpoint holds
before trusting it; writers derive it from a `QuantizedWeight`. It is the only thing a format
needs besides the tensors themselves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.errors import QuantkitError
from quantkit.qtensor import QuantizedWeight

ACT_ORDERS = ("none", "static", "dynamic")
INPUT_QUANTS = (None, "token", "tensor")  # weight-only, int8 dynamic per token, int8 static per tensor


@dataclass(frozen=True)
class LinearSpec:
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
