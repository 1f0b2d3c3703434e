"""Quantizing onto llama.cpp's grids, so what RTN or GPTQ optimise is what llama.cpp decodes.

`choose_grid` picks each block's parameters the way llama.cpp's `quantize_row_*_ref` does
(ggml-quants.c): Q4_0/Q5_0 d = (signed max)/-8|-16, Q8_0 d = absmax/127, Q4_1/Q5_1 d = range/qmax
with m = min; the k-quants search each sub-block's (scale, min) with make_qkx2_quants (Q4_K/Q5_K)
or make_qx_quants (Q6_K), then quantize the sub-scales to 6 (8) bits under one fp16 d per 256.
One deliberate difference: a sub-scale or d that llama.cpp would set to 0 is kept at the smallest
non-zero value, so every group has a usable step (the grid then holds llama.cpp's point as well).

The grid is fixed before any code is chosen (for GPTQ: from the original weights, like static
groups); `round_to_grid` is RTN on it and `on_grid` turns codes into the QuantizedWeight the GGUF
packer stores exactly. GPTQ runs on `w - offsets` with the plain scale/zero grid (`shifted`):
GPTQ only uses differences w - q and additive updates, so that is the same problem.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.ggml_types import QK_K, GGMLType
from quantkit.qtensor import QuantizedWeight, TwoLevelScales

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


def choose_grid(weight: torch.Tensor, t: GGMLType) -> GridParams:
    """llama.cpp's block parameters for `weight` [N, K] in type `t` (no importance matrix)."""
    n, k = weight.shape
    if not t.quantized or k % t.block:
        raise ValueError(f"{t.name} cannot quantize rows of {k} columns")
    w = weight.detach().float()
    if t.two_level:
        return _two_level_grid(w, t)
    blocks = w.reshape(n, k // 32, 32)
    if t.zero is not None:
        if t.bits == 8:
            d = blocks.abs().amax(-1) / 127
        else:  # the signed value of largest magnitude over -8 (-16): codes -8..7 reach it exactly
            idx = blocks.abs().argmax(-1, keepdim=True)
            d = blocks.gather(-1, idx).squeeze(-1) / -float(t.zero)
        return GridParams(t, _nonzero_f16(d), torch.full_like(d, float(t.zero)))
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = (hi - lo) / ((1 << t.bits) - 1)
    return GridParams(t, _nonzero_f16(d), torch.zeros_like(d), offset=lo.to(torch.float16).float())


def _nonzero_f16(d: torch.Tensor) -> torch.Tensor:
    d = d.to(torch.float16).float()
    return torch.where(d == 0, torch.full_like(d, F16_TINY), d)


def _two_level_grid(w: torch.Tensor, t: GGMLType) -> GridParams:
    n, k = w.shape
    n_super = k // QK_K
    sub = w.reshape(-1, t.group)  # every sub-block of every row
    if t.zero is None:  # Q4_K / Q5_K: (scale, min) per 32, 6-bit each under fp16 d and dmin
        av = sub.square().mean(-1, keepdim=True).sqrt()
        nmax = (1 << t.bits) - 1
        rmin, nstep = (-1.0, 20) if t.bits == 4 else (-0.5, 15)
        scales, mins = make_qkx2_quants(sub, nmax, av + sub.abs(), rmin, 0.1, nstep)
        d, sc = _sub_scales(scales.view(n, n_super, -1), 63)
        dmin, m = _sub_scales(mins.view(n, n_super, -1), 63, allow_zero=True)
        tl = TwoLevelScales(d=d.view(n, n_super), sc=sc.view(n, -1), super_size=QK_K, dmin=dmin.view(n, n_super),
                            m=m.view(n, -1))
        return GridParams(t, tl.scales(), torch.zeros(n, k // t.group), offset=tl.offsets(), two_level=tl)
    scales = make_qx_quants(sub, 32).view(n, n_super, -1)  # Q6_K: signed scale per 16
    idx = scales.abs().argmax(-1, keepdim=True)
    max_scale = scales.gather(-1, idx)
    iscale = torch.where(max_scale.abs() < 1e-15, torch.zeros_like(max_scale), -128.0 / max_scale)
    d = _nonzero_f16(torch.where(iscale == 0, torch.zeros_like(iscale), 1.0 / iscale)).squeeze(-1)
    sc = torch.round(iscale * scales).clamp_(max=127)
    sc = torch.where(sc == 0, torch.ones_like(sc), sc).to(torch.int16)
    tl = TwoLevelScales(d=d, sc=sc.view(n, -1), super_size=QK_K)
    return GridParams(t, tl.scales(), torch.full((n, k // t.group), float(t.zero)), two_level=tl)


def _sub_scales(values: torch.Tensor, top: int, allow_zero: bool = False):
    """Per super-block: fp16 d = max/top and integer sub-scales round(value/max*top) in [0, top]
    (llama.cpp's step); sub-scales of 0 become 1 unless `allow_zero` (mins may be 0)."""
    vmax = values.amax(-1).clamp(min=0)
    inv = torch.where(vmax > 0, top / vmax, torch.zeros_like(vmax))
    q = torch.round(inv.unsqueeze(-1) * values).clamp_(0, top)
    d = (vmax / top).to(torch.float16).float()
    if not allow_zero:
        q = torch.where(q == 0, torch.ones_like(q), q)
        d = torch.where(d == 0, torch.full_like(d, F16_TINY), d)
    return d, q.to(torch.int16)


def make_qkx2_quants(x: torch.Tensor, nmax: int, weights: torch.Tensor, rmin: float, rdelta: float, nstep: int):
    """llama.cpp's make_qkx2_quants over rows of x [B, n]: the (scale, min) with the lowest weighted
    squared error among nstep+1 trial steps, each refit by weighted least squares with min <= 0.
    Returns scale [B] and the positive min [B] (value = scale * q - min)."""
    lo = x.amin(-1).clamp(max=0)
    hi = x.amax(-1)
    rng = hi - lo
    flat = rng == 0
    rng = torch.where(flat, torch.ones_like(rng), rng)
    sum_w = weights.sum(-1)
    sum_x = (weights * x).sum(-1)

    def codes(iscale):
        return torch.round(iscale.unsqueeze(-1) * (x - lo.unsqueeze(-1))).clamp_(0, nmax)

    def error(scale, mn, L):
        return (weights * (scale.unsqueeze(-1) * L + mn.unsqueeze(-1) - x).square()).sum(-1)

    best_scale, best_min = rng / nmax, lo
    best_err = error(best_scale, best_min, codes(nmax / rng))
    for step in range(nstep + 1):
        L = codes((rmin + rdelta * step + nmax) / rng)
        sum_l, sum_l2, sum_xl = (weights * L).sum(-1), (weights * L * L).sum(-1), (weights * L * x).sum(-1)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        D = torch.where(ok, D, torch.ones_like(D))
        scale = (sum_w * sum_xl - sum_x * sum_l) / D
        mn = (sum_l2 * sum_x - sum_l * sum_xl) / D
        positive = mn > 0
        mn = torch.where(positive, torch.zeros_like(mn), mn)
        scale = torch.where(positive, sum_xl / sum_l2.clamp(min=1e-30), scale)
        err = error(scale, mn, L)
        better = ok & (err < best_err)
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_min = torch.where(better, mn, best_min)
    best_scale = torch.where(flat, torch.zeros_like(best_scale), best_scale)
    return best_scale, -best_min


def make_qx_quants(x: torch.Tensor, nmax: int) -> torch.Tensor:
    """llama.cpp's make_qx_quants(rmse_type=1) over rows of x [B, n]: a signed scale (value = scale * l,
    l in [-nmax, nmax-1]) fit by x^2-weighted least squares over 19 trial steps."""
    idx = x.abs().argmax(-1, keepdim=True)
    vmax = x.gather(-1, idx).squeeze(-1)
    empty = vmax.abs() < 1e-15
    vmax = torch.where(empty, torch.ones_like(vmax), vmax)
    w = x * x

    def fit(iscale):
        L = torch.round(iscale.unsqueeze(-1) * x).clamp_(-nmax, nmax - 1)
        return (w * x * L).sum(-1), (w * L * L).sum(-1)

    sumlx, suml2 = fit(-nmax / vmax)
    scale = torch.where(suml2 > 0, sumlx / suml2.clamp(min=1e-30), torch.zeros_like(sumlx))
    best = scale * sumlx
    for step in [s for s in range(-9, 10) if s]:
        sumlx, suml2 = fit(-(nmax + 0.1 * step) / vmax)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = torch.where(better, sumlx / suml2.clamp(min=1e-30), scale)
        best = torch.where(better, scale * sumlx, best)
    return torch.where(empty, torch.zeros_like(scale), scale)
