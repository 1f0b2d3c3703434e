"""Quantizing onto llama.cpp's grids, so what RTN or GPTQ optimise is what llama.cpp decodes.

`choose_grid` picks each block's parameters the way llama.cpp's `quantize_row_*` does
(ggml-quants.c; the searches themselves are in `ggml_search`). Without an importance matrix, the
reference rules: Q4_0/Q5_0 d = (signed max)/-8|-16, Q8_0 d = absmax/127, Q4_1/Q5_1 d = range/qmax
with m = min; the k-quants search each sub-block's (scale, min) with make_qkx2_quants (Q4_K/Q5_K)
or make_qx_quants (Q6_K), then quantize the sub-scales to 6 (8) bits under one fp16 d per 256.
With one (`importance`, a weight per input column: llama-imatrix's mean squared activation, or
GPTQ's Hessian diagonal, which is proportional to it), `quantize_row_*_impl`'s searches: every
block's scale (and min) fit to the importance-weighted error, and the k-quants' sub-scales to each
sub-block's summed importance. One deliberate difference: a sub-scale or d that llama.cpp would set
to 0 is kept at the smallest non-zero value, so every group has a usable step (the grid then holds
llama.cpp's point as well).

The grid is fixed before any code is chosen (for GPTQ: from the original weights, like static
groups); `round_to_grid` is RTN on it and `on_grid` turns codes into the QuantizedWeight the GGUF
packer stores exactly. GPTQ runs on `w - offsets` with the plain scale/zero grid (`shifted`):
GPTQ only uses differences w - q and additive updates, so that is the same problem.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.formats.gguf.types import QK_K, GGMLType
from quantkit.qtensor import QuantizedWeight, TwoLevelScales
from quantkit.quantizers.ggml_search import GROUP_MAX_EPS, make_qkx_quants, make_qp_quants, make_qx_quants

F16_TINY = 2.0 ** -24  # smallest positive fp16 (subnormal)


@dataclass
class GridParams:
    """One weight's grid: value = scale * (code - zero) + offset per group of `t.group` columns."""

    t: GGMLType
    scale: torch.Tensor  # float32 [N, G], never 0
    zero: torch.Tensor  # float32 [N, G], integer values (the type's zero, or 0 for offset grids)
    offset: Optional[torch.Tensor] = None  # float32 [N, G]
    two_level: Optional[TwoLevelScales] = None

    def per_column(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(self.t.group, dim=1)

    def shifted(self, w: torch.Tensor) -> torch.Tensor:
        """w minus each group's offset: on it the grid is scale * (code - zero), which GPTQ takes."""
        return w.float() if self.offset is None else w.float() - self.per_column(self.offset)

    def on_grid(self, codes: torch.Tensor, bias: Optional[torch.Tensor] = None) -> QuantizedWeight:
        n, k = codes.shape
        t = self.t
        return QuantizedWeight(qweight=codes.to(torch.uint8), scales=self.scale.clone(),
                               zeros=self.zero.to(torch.int32), g_idx=torch.arange(k, dtype=torch.int32) // t.group,
                               bits=t.bits, group_size=t.group, sym=t.zero is not None,
                               bias=None if bias is None else bias.detach().clone(),
                               offsets=None if self.offset is None else self.offset.clone(), two_level=self.two_level)


def round_to_grid(w: torch.Tensor, p: GridParams) -> torch.Tensor:
    """Nearest code of each weight on the fixed grid (RTN), uint8 [N, K]."""
    maxq = (1 << p.t.bits) - 1
    q = torch.round(p.shifted(w) / p.per_column(p.scale)) + p.per_column(p.zero)
    return q.clamp_(0, maxq).to(torch.uint8)


def rtn_on_grid(weight: torch.Tensor, t: GGMLType, bias: Optional[torch.Tensor] = None) -> QuantizedWeight:
    p = choose_grid(weight, t)
    return p.on_grid(round_to_grid(weight, p), bias)


def choose_grid(weight: torch.Tensor, t: GGMLType, importance: Optional[torch.Tensor] = None) -> GridParams:
    """llama.cpp's block parameters for `weight` [N, K] in type `t`; with `importance` [K] (>= 0, any
    scale), those llama-quantize chooses under an importance matrix (Q8_0 ignores it, as llama.cpp does)."""
    n, k = weight.shape
    if not t.quantized or k % t.block:
        raise ValueError(f"{t.name} cannot quantize rows of {k} columns")
    w = weight.detach().float()
    if importance is not None:
        importance = _checked_importance(importance, k, w.device)
    if t.two_level:
        return _two_level_grid(w, t, importance)
    blocks = w.reshape(n, k // 32, 32)
    if t.zero is not None and (t.bits == 8 or importance is None):
        if t.bits == 8:
            d = blocks.abs().amax(-1) / 127
        else:  # the signed value of largest magnitude over -8 (-16): codes -8..7 reach it exactly
            idx = blocks.abs().argmax(-1, keepdim=True)
            d = blocks.gather(-1, idx).squeeze(-1) / -float(t.zero)
        return GridParams(t, _nonzero_f16(d), torch.full_like(d, float(t.zero)))
    if importance is None:
        lo, hi = blocks.amin(-1), blocks.amax(-1)
        d = (hi - lo) / ((1 << t.bits) - 1)
        return GridParams(t, _nonzero_f16(d), torch.zeros_like(d), offset=lo.to(torch.float16).float())
    # quantize_row_q4_0/q5_0/q4_1/q5_1_impl: importance times sqrt(sigma^2 + x^2), sigma^2 the row's mean x^2
    sigma2 = w.square().mean(1).view(n, 1, 1)
    weights = (importance.view(1, -1, 32) * (sigma2 + blocks.square()).sqrt()).reshape(-1, 32)
    if t.zero is not None:
        d = make_qx_quants(blocks.reshape(-1, 32), t.zero, weights).view(n, -1)
        return GridParams(t, _nonzero_f16(d), torch.full_like(d, float(t.zero)))
    d, the_min = make_qkx_quants(blocks.reshape(-1, 32), (1 << t.bits) - 1, weights, -0.9, 0.05, 36)
    return GridParams(t, _nonzero_f16(d.view(n, -1)), torch.zeros(n, k // 32),
                      offset=(-the_min).view(n, -1).to(torch.float16).float())


def _checked_importance(importance: torch.Tensor, k: int, device) -> torch.Tensor:
    """Importance as float32 [k]; refuses a wrong length or a negative or non-finite value. A column
    with none (no calibration input reached it) gets a millionth of the mean, so a block of only such
    columns still gets a grid fit to its weights rather than llama.cpp's d = 0."""
    imp = importance.detach().float().to(device).flatten()
    if imp.numel() != k or not bool(torch.isfinite(imp).all()) or bool((imp < 0).any()):
        raise ValueError(f"importance must be {k} finite non-negative values, got {tuple(importance.shape)}")
    floor = float(imp.mean()) * 1e-6
    return imp.clamp(min=floor) if floor > 0 else torch.ones_like(imp)


def _nonzero_f16(d: torch.Tensor) -> torch.Tensor:
    d = d.to(torch.float16).float()
    return torch.where(d == 0, torch.full_like(d, F16_TINY), d)


def _two_level_grid(w: torch.Tensor, t: GGMLType, importance: Optional[torch.Tensor]) -> GridParams:
    n, k = w.shape
    n_super = k // QK_K
    sub = w.reshape(-1, t.group)  # every sub-block of every row
    if importance is not None:
        imp = importance.view(1, k // t.group, t.group).expand(n, -1, -1).reshape(-1, t.group)
    if t.zero is None:  # Q4_K / Q5_K: (scale, min) per 32, 6-bit each under fp16 d and dmin
        nmax = (1 << t.bits) - 1
        if importance is None:  # quantize_row_q4_K/q5_K_ref
            av = sub.square().mean(-1, keepdim=True).sqrt()
            rmin, nstep = (-1.0, 20) if t.bits == 4 else (-0.5, 15)
            scales, mins = make_qkx_quants(sub, nmax, av + sub.abs(), rmin, 0.1, nstep)
            d, sc = _sub_scales(scales.view(n, n_super, -1), 63)
            dmin, m = _sub_scales(mins.view(n, n_super, -1), 63, allow_zero=True)
        else:  # quantize_row_q4_K/q5_K_impl: sigma^2 = 2 * mean x^2 over the super-block
            sigma2 = 2 * w.view(n, n_super, QK_K).square().mean(-1)
            sigma2 = sigma2.repeat_interleave(QK_K // t.group, dim=1).reshape(-1, 1)
            weights = imp * (sigma2 + sub.square()).sqrt()
            scales, mins = make_qkx_quants(sub, nmax, weights, -0.9, 0.05, 36)
            sw = weights.sum(-1).view(n * n_super, -1)
            d, sc = _weighted_sub_scales(scales.clamp(min=0).view(n * n_super, -1), sw, 63)
            dmin, m = _weighted_sub_scales(mins.clamp(min=0).view(n * n_super, -1), sw, 63, allow_zero=True)
        tl = TwoLevelScales(d=d.view(n, n_super), sc=sc.view(n, -1), super_size=QK_K, dmin=dmin.view(n, n_super),
                            m=m.view(n, -1))
        return GridParams(t, tl.scales(), torch.zeros(n, k // t.group), offset=tl.offsets(), two_level=tl)
    # Q6_K: signed scale per 16 (quantize_row_q6_K_impl weighs by the importance alone)
    scales = make_qx_quants(sub, 32, None if importance is None else imp).view(n, n_super, -1)
    idx = scales.abs().argmax(-1, keepdim=True)
    max_scale = scales.gather(-1, idx)
    iscale = torch.where(max_scale.abs() < GROUP_MAX_EPS, torch.zeros_like(max_scale), -128.0 / max_scale)
    d = _nonzero_f16(torch.where(iscale == 0, torch.zeros_like(iscale), 1.0 / iscale)).squeeze(-1)
    sc = torch.round(iscale * scales).clamp_(max=127)
    sc = torch.where(sc == 0, torch.ones_like(sc), sc).to(torch.int16)
    tl = TwoLevelScales(d=d, sc=sc.view(n, -1), super_size=QK_K)
    return GridParams(t, tl.scales(), torch.full((n, k // t.group), float(t.zero)), two_level=tl)


def _weighted_sub_scales(values: torch.Tensor, sw: torch.Tensor, top: int, allow_zero: bool = False):
    """Per super-block (rows of `values`): fp16 d and integer sub-scales in [0, top] by make_qp_quants
    under the sub-blocks' summed importance `sw`, stored as `_stored_sub_scales` does."""
    d, q = make_qp_quants(values, top, sw)
    return _stored_sub_scales(d, q, allow_zero)


def _sub_scales(values: torch.Tensor, top: int, allow_zero: bool = False):
    """Per super-block: fp16 d = max/top and integer sub-scales round(value/max*top) in [0, top]
    (llama.cpp's step); sub-scales of 0 become 1 unless `allow_zero` (mins may be 0)."""
    vmax = values.amax(-1).clamp(min=0)
    inv = torch.where(vmax > 0, top / vmax, torch.zeros_like(vmax))
    q = torch.round(inv.unsqueeze(-1) * values).clamp_(0, top)
    return _stored_sub_scales(vmax / top, q, allow_zero)


def _stored_sub_scales(d: torch.Tensor, q: torch.Tensor, allow_zero: bool):
    """d as the fp16 value the file stores and q as int16; unless `allow_zero`, a 0 becomes the
    smallest usable value (d: F16_TINY, q: 1) so every group keeps a step."""
    d = d.to(torch.float16).float()
    if not allow_zero:
        q = torch.where(q == 0, torch.ones_like(q), q)
        d = torch.where(d == 0, torch.full_like(d, F16_TINY), d)
    return d, q.to(torch.int16)


