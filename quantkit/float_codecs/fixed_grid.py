"""A weight's float grid with its scales fixed in advance, for algorithms that choose the codes themselves (GPTQ).

The scales are the format's own, computed from the original weight exactly as round-to-nearest computes them
(`fp8`, `mxfp8` and `mxfp4` with their E8M0 exponents, `nvfp4` with its global scale; with its range search where on,
`scale_search`), before any code is chosen, as GPTQ's
static groups do. `round_column` rounds a column onto the grid under those scales (the nearest E4M3 or E2M1
value of w / scale, times scale), and `encode` turns a weight whose every element is on the grid into the
layout's weight object (`Fp8Weight`, `Mxfp8Weight`, `Nvfp4Weight`, `Mxfp4Weight`), checked to dequantize back to it exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from quantkit.errors import QuantkitError
from quantkit.float_codecs import e2m1, e4m3, e8m0, fp8, mxfp4, mxfp8, nvfp4, scale_search
from quantkit.scheme_presets import QuantArgs

FloatWeight = Union[fp8.Fp8Weight, mxfp8.Mxfp8Weight, nvfp4.Nvfp4Weight, mxfp4.Mxfp4Weight]


@dataclass
class FixedFloatGrid:
    rtn: FloatWeight  # round-to-nearest under these scales: the scales themselves, and the RTN baseline
    step: torch.Tensor  # float32 [N, K]: each element's scale

    def __post_init__(self):
        self.e4m3_elements = isinstance(self.rtn, (fp8.Fp8Weight, mxfp8.Mxfp8Weight))  # else E2M1
        self.step_t = self.step.t().contiguous()  # [K, N]: one column's scales contiguous

    def round_column(self, w: torch.Tensor, col: int) -> torch.Tensor:
        """Column `col` of a weight ([N] values) rounded onto the grid."""
        s = self.step_t[col]
        if self.e4m3_elements:
            return e4m3.to_e4m3(w / s).to(torch.float32) * s
        return e2m1.nearest_value(w / s) * s

    def encode(self, w_hat: torch.Tensor) -> FloatWeight:
        """The layout's weight object of `w_hat` (every element already on this grid)."""
        q = self.rtn
        if isinstance(q, fp8.Fp8Weight):
            out = fp8.Fp8Weight(e4m3.to_e4m3(w_hat / self.step), q.scale, q.strategy, q.block_size)
        elif isinstance(q, mxfp8.Mxfp8Weight):
            out = mxfp8.Mxfp8Weight(e4m3.to_e4m3(w_hat / self.step), q.scale_codes)
        elif isinstance(q, nvfp4.Nvfp4Weight):
            out = nvfp4.Nvfp4Weight(e2m1.encode(w_hat / self.step), q.group_scale, q.global_scale)
        else:
            out = mxfp4.Mxfp4Weight(e2m1.encode(w_hat / self.step), q.scale_codes)
        if not torch.equal(out.dequantize(), w_hat):
            raise QuantkitError("a weight chosen on a float grid does not encode back to itself; this is a bug")
        return out


def fixed_grid(weight: torch.Tensor, weights: QuantArgs, global_scale: Optional[torch.Tensor] = None,
               search: Optional[bool] = None, importance: Optional[torch.Tensor] = None) -> FixedFloatGrid:
    """The format's scales for `weight` [N, K] under the weights args (FP8 tensor/channel/block, NVFP4 under
    `global_scale` when given, MXFP4), with round-to-nearest's range search (`scale_search`) when `search`
    says so (None: the format's default), its error weighted per input column by `importance` [K] when given."""
    w = weight.detach().to(torch.float32)
    if weights.kind == "float" and weights.bits in (4, 8):
        search = scale_search.enabled(weights, search)
    if (weights.kind, weights.bits, weights.strategy) == ("float", 8, "group"):
        q = mxfp8.quantize(w, search=search)
        step = q.element_scale()
    elif (weights.kind, weights.bits) == ("float", 8):
        q = fp8.quantize(w, weights.strategy, weights.block_size, search=search, importance=importance)
        step = q.element_scale()
    elif weights.strategy == "tensor_group":
        q = nvfp4.quantize(w, gscale=global_scale, search=search, importance=importance)
        step = (q.group_scale.to(torch.float32) / q.global_scale).repeat_interleave(nvfp4.GROUP_SIZE, dim=1)
    elif (weights.kind, weights.bits, weights.strategy) == ("float", 4, "group"):
        q = mxfp4.quantize(w, search=search, importance=importance)
        step = e8m0.decode(q.scale_codes).repeat_interleave(mxfp4.GROUP_SIZE, dim=1)
    else:
        raise QuantkitError(f"no fixed float grid for {weights.kind} {weights.bits}-bit {weights.strategy} weights")
    return FixedFloatGrid(q, step.contiguous())
