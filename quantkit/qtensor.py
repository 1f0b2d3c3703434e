"""The format-neutral quantized weight that quantizers produce and every packer consumes.

Keeping one canonical form means a quantizer never knows about on-disk layouts and a layout
never knows about quantizers: `formats/*` convert to and from this, nothing else.

Convention (GPTQ's, shared by AWQ and compressed-tensors once offsets are applied):
    W[n, k] = scales[n, g_idx[k]] * (qweight[n, k] - zeros[n, g_idx[k]])
with unsigned integer codes qweight in [0, 2**bits) and integer zeros in the same range.
Symmetric schemes use zeros == 2**(bits-1) everywhere.

Grids whose offset is a float, not an integer zero (llama.cpp's Q4_1/Q5_1 and k-quants: value =
d*q + m), carry `offsets` (float32 [N, n_groups], added after scaling; zeros are then 0):
    W[n, k] = scales[n, g] * (qweight[n, k] - zeros[n, g]) + offsets[n, g]
Two-level grids (the k-quants: per 256 columns an fp16 d (and dmin), per sub-block a small integer
sc (and m)) also carry `two_level`, from which `scales` (= d*sc) and `offsets` (= -dmin*m) are
derived exactly; a packer needs the integers, which a float product does not give back.
Layouts that cannot hold either refuse such a weight (formats/checks.py).

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
class TwoLevelScales:
    """k-quant scales: per super-block (`super_size` columns) d and dmin (fp16 values in float32
    [N, n_super]), per group an integer sc and m (int16 [N, n_groups]); sc is signed for Q6_K.
    scale = d * sc and offset = -(dmin * m), both exact in float32."""

    d: torch.Tensor
    sc: torch.Tensor
    super_size: int
    dmin: Optional[torch.Tensor] = None  # None: symmetric k-quant (Q6_K), no offsets
    m: Optional[torch.Tensor] = None

    def per_group(self, name: str) -> Optional[torch.Tensor]:
        """d (or dmin) repeated for each group of its super-block: [N, n_groups]."""
        t = self.d if name == "d" else self.dmin
        if t is None:
            return None
        return t.repeat_interleave(self.sc.shape[1] // t.shape[1], dim=1)

    def scales(self) -> torch.Tensor:
        return self.per_group("d") * self.sc.float()

    def offsets(self) -> Optional[torch.Tensor]:
        return None if self.dmin is None else -(self.per_group("dmin") * self.m.float())

    def to(self, device) -> "TwoLevelScales":
        move = (lambda t: None if t is None else t.to(device))
        return TwoLevelScales(d=move(self.d), sc=move(self.sc), super_size=self.super_size, dmin=move(self.dmin),
                              m=move(self.m))

    def select_rows(self, rows) -> "TwoLevelScales":
        pick = (lambda t: None if t is None else t[rows].clone())
        return TwoLevelScales(d=pick(self.d), sc=pick(self.sc), super_size=self.super_size, dmin=pick(self.dmin),
                              m=pick(self.m))


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
    offsets: Optional[torch.Tensor] = None  # float32 [N, n_groups] added after scaling (float-min grids)
    two_level: Optional[TwoLevelScales] = None  # k-quant integers behind scales/offsets

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
            w = (self.qweight.reshape(n, groups, gs).float() - z) * s
            if self.offsets is not None:
                w = w + self.offsets.float().unsqueeze(2)
            return w.reshape(n, k).to(dtype)
        g = self.g_idx.long()
        s = self.scales.float()[:, g]
        z = self.zeros.float()[:, g]
        w = (self.qweight.float() - z) * s
        if self.offsets is not None:
            w = w + self.offsets.float()[:, g]
        return w.to(dtype)

    def to(self, device) -> "QuantizedWeight":
        """Every tensor (codes, scales, zeros, g_idx, bias, offsets, k-quant scales) on `device`."""
        from dataclasses import replace

        move = (lambda t: None if t is None else t.detach().to(device))
        return replace(self, qweight=move(self.qweight), scales=move(self.scales), zeros=move(self.zeros),
                       g_idx=move(self.g_idx), bias=move(self.bias), offsets=move(self.offsets),
                       two_level=None if self.two_level is None else self.two_level.to(device))

    def select_rows(self, rows) -> "QuantizedWeight":
        """The output rows `rows` (a slice) as their own QuantizedWeight (a stacked solve split up)."""
        from dataclasses import replace

        return replace(self, qweight=self.qweight[rows].clone(), scales=self.scales[rows].clone(),
                       zeros=self.zeros[rows].clone(), bias=None if self.bias is None else self.bias[rows].clone(),
                       offsets=None if self.offsets is None else self.offsets[rows].clone(),
                       two_level=None if self.two_level is None else self.two_level.select_rows(rows))

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
