"""Integer grids: scale/zero selection and rounding, shared by every weight quantizer.

One place decides the conventions (GPTQ's): symmetric uses scale = 2*absmax/(2**b - 1) with the
zero fixed at 2**(b-1); asymmetric uses scale = (max - min)/(2**b - 1) over a range widened to
include 0, zero = round(-min/scale). Scales are rounded to the storage dtype (fp16) *before*
the codes are computed, so a packed checkpoint dequantizes to exactly what the quantizer saw.
"""
from __future__ import annotations

import torch

from quantkit.qtensor import QuantizedWeight

SCALE_DTYPE = torch.float16
# reference `Quantizer.find_params(..., mse=True)` search: shrink factors 1 - i/grid for
# i < maxshrink*grid, error norm |q - x|^norm summed over the row
MSE_GRID = 100
MSE_MAXSHRINK = 0.8
MSE_NORM = 2.4


def max_code(bits: int) -> int:
    return (1 << bits) - 1


def compute_qparams(w: torch.Tensor, bits: int, sym: bool, clip_ratio: float | torch.Tensor = 1.0):
    """Scale and zero per row of `w` ([rows, cols]); returns float32 scale [rows], float32 zero [rows]."""
    maxq = max_code(bits)
    w = w.float()
    xmin = torch.clamp(w.amin(dim=1), max=0.0) * clip_ratio
    xmax = torch.clamp(w.amax(dim=1), min=0.0) * clip_ratio
    if sym:
        amax = torch.maximum(xmin.abs(), xmax)
        scale = 2.0 * amax / maxq
        zero = torch.full_like(scale, float((maxq + 1) // 2))
    else:
        scale = (xmax - xmin) / maxq
        zero = None
    tiny = torch.finfo(SCALE_DTYPE).tiny
    scale = torch.where(scale > tiny, scale, torch.ones_like(scale))
    scale = scale.to(SCALE_DTYPE).float()
    if zero is None:
        zero = torch.clamp(torch.round(-xmin / scale), 0, maxq)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes (as float) for `w` [rows, cols] with per-row scale/zero [rows] or [rows, 1]."""
    if scale.dim() == 1 and w.dim() > 1:
        scale, zero = scale.unsqueeze(1), zero.unsqueeze(1)
    return torch.div(w.float(), scale).round_().add_(zero).clamp_(0, max_code(bits))


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    if scale.dim() == 1:
        scale, zero = scale.unsqueeze(1), zero.unsqueeze(1)
    return (quantize_codes(w, scale, zero, bits) - zero) * scale


def rtn_quantize(weight: torch.Tensor, bits: int, group_size: int, sym: bool,
                 bias: torch.Tensor | None = None, mse: bool = False) -> QuantizedWeight:
    """Round-to-nearest with per-group min/max ranges (with `mse`, each group's range shrunk to the
    one with the lowest rounding error, `find_qparams`); vectorised over all groups at once."""
    n, k = weight.shape
    gs = k if group_size == -1 else group_size
    if k % gs:
        raise ValueError(f"group size {gs} does not divide in_features {k}")
    groups = k // gs
    w = weight.float().reshape(n * groups, gs)
    scale, zero = find_qparams(w, bits, sym, mse)
    q = quantize_codes(w, scale, zero, bits).reshape(n, k)
    return QuantizedWeight(
        qweight=q.to(torch.uint8),
        scales=scale.reshape(n, groups),
        zeros=zero.reshape(n, groups).to(torch.int32),
        g_idx=(torch.arange(k, dtype=torch.int32) // gs),
        bits=bits,
        group_size=group_size,
        sym=sym,
        bias=None if bias is None else bias.detach().clone(),
    )


def fake_quantize_grouped(w: torch.Tensor, scheme) -> torch.Tensor:
    """Quantize-dequantize ``w`` [N, K] per group with `grid`'s conventions (what rtn_quantize stores)."""
    n, k = w.shape
    gs = k if scheme.group_size == -1 else scheme.group_size
    wg = w.float().reshape(-1, gs)
    scale, zero = compute_qparams(wg, scheme.bits, scheme.sym)
    return fake_quantize(wg, scale, zero, scheme.bits).reshape(n, k).to(w.dtype)


def find_qparams(x: torch.Tensor, bits: int, sym: bool, mse: bool = False,
                 grid: int = MSE_GRID, maxshrink: float = MSE_MAXSHRINK, norm: float = MSE_NORM):
    """Scale/zero per row of x [rows, cols] (fp32 [rows] each), optionally with the reference
    MSE range-shrink search, vectorised over all shrink factors (chunked to bound memory)."""
    if not mse:
        return compute_qparams(x, bits, sym)
    x = x.float()
    rows, cols = x.shape
    # compute_qparams only looks at each row's min and max, so a [rows, 2] (min, max) stand-in
    # gives the identical scale/zero and lets every shrink factor share one call
    mm = torch.stack([x.amin(dim=1), x.amax(dim=1)], dim=1)
    n_p = int(maxshrink * grid)
    ps = 1.0 - torch.arange(n_p, dtype=torch.float64, device=x.device) / grid
    ps = ps.to(torch.float32)
    chunk = max(1, min(n_p, (1 << 23) // max(1, rows * cols)))
    best_err = best_scale = best_zero = None
    for c0 in range(0, n_p, chunk):
        pc = ps[c0:c0 + chunk]
        k = pc.numel()
        scale, zero = compute_qparams(mm.repeat(k, 1), bits, sym, clip_ratio=pc.repeat_interleave(rows))
        scale, zero = scale.view(k, rows, 1), zero.view(k, rows, 1)
        d = (fake_quantize(x.unsqueeze(0), scale, zero, bits) - x).abs_()
        # |d|**norm as exp(norm*log|d|): ~3x faster than pow on CPU, equal to a few ulp (0 -> 0)
        err = d.log_().mul_(norm).exp_().sum(dim=2)
        e, j = err.min(dim=0)  # first minimum: the largest p wins ties, like the reference's strict <
        s = scale.squeeze(2).gather(0, j.unsqueeze(0)).squeeze(0)
        z = zero.squeeze(2).gather(0, j.unsqueeze(0)).squeeze(0)
        if best_err is None:
            best_err, best_scale, best_zero = e, s, z
        else:
            better = e < best_err
            best_err = torch.where(better, e, best_err)
            best_scale = torch.where(better, s, best_scale)
            best_zero = torch.where(better, z, best_zero)
    return best_scale, best_zero
