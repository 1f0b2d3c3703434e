"""Integer grids: scale/zero selection and rounding, shared by every weight quantizer.

One place decides the conventions (GPTQ's): symmetric uses scale = 2*absmax/(2**b - 1) with the
zero fixed at 2**(b-1) (`sym_range` "centred"; "exact" is AutoAWQ's absmax/(2**(b-1) - 1), "full"
auto-round's signed absmax/2**(b-1), see SYM_RANGES); asymmetric uses scale = (max - min)/(2**b - 1)
over a range widened to include 0, zero = round(-min/scale). Scales are rounded to the storage dtype (fp16) *before*
the codes are computed, so a packed checkpoint dequantizes to exactly what the quantizer saw.
"""
from __future__ import annotations

from typing import Optional

import torch

from quantkit.errors import QuantkitError
from quantkit.qtensor import QuantizedWeight

SCALE_DTYPE = torch.float16
# reference `Quantizer.find_params(..., mse=True)` search: shrink factors 1 - i/grid for
# i < maxshrink*grid, error norm |q - x|^norm summed over the row
MSE_GRID = 100
MSE_MAXSHRINK = 0.8
MSE_NORM = 2.4
# coarse-to-fine: every 4th shrink factor, then the neighbours of the best (find_qparams)
MSE_COARSE_STEP = 4

# Where a symmetric grid puts +-absmax (4 bits: codes -8..7 around the zero 8):
#   centred  scale = 2*absmax/(2**b - 1) (absmax/7.5), GPTQ's reference and llm-compressor's: all 16
#            codes in use, but +-absmax fall half a step outside them, so a group's largest weight is
#            always rounded by half a step;
#   exact    scale = absmax/(2**(b-1) - 1) (absmax/7), AutoAWQ's and GPTQModel's AWQ: +-absmax land
#            on codes +-7 exactly (code -8 goes unused), a 7 % coarser step. AWQ scales its salient
#            input channels up until they hold their groups' largest weights, which this grid keeps
#            exact (docs/defaults.yaml has the measurement).
#   full     scale = signed absmax/2**(b-1) (absmax/8), auto-round's `int_sym` and llama.cpp's Q4_0: the
#            scale's sign is chosen so the group's largest-magnitude weight lands on code -8 exactly, so
#            that side gets 8 steps and the other 7 (a grid mirrored per group, not only a smaller step:
#            the centred grid's MSE search shrinks the step but always gives the positive side 7).
#            The scale is negative where the positive extreme dominates; storage is unchanged (codes
#            0..15, zero 8, fp16 scales: dequantized (q - 8) * scale by every reader).
SYM_RANGES = ("centred", "exact", "full")


def max_code(bits: int) -> int:
    return (1 << bits) - 1


def check_sym_range(sym_range: str, owner: str = "") -> str:
    """`sym_range` if it names one of SYM_RANGES, else a one-line error (``owner``: e.g. "awq option ")."""
    if sym_range not in SYM_RANGES:
        raise QuantkitError(f"{owner}sym_range must be one of {', '.join(SYM_RANGES)}, got {sym_range!r}")
    return sym_range


def compute_qparams(w: torch.Tensor, bits: int, sym: bool, clip_ratio: float | torch.Tensor = 1.0,
                    sym_range: str = "centred"):
    """Scale and zero per row of `w` ([rows, cols]); returns float32 scale [rows], float32 zero [rows]."""
    maxq = max_code(bits)
    w = w.float()
    xmin = torch.clamp(w.amin(dim=1), max=0.0) * clip_ratio
    xmax = torch.clamp(w.amax(dim=1), min=0.0) * clip_ratio
    if sym:
        amax = torch.maximum(xmin.abs(), xmax)
        half = (maxq + 1) // 2
        if check_sym_range(sym_range) == "centred":
            scale = 2.0 * amax / maxq
        elif sym_range == "exact":
            scale = amax / (maxq // 2)
        else:  # full: the dominant extreme on code -half (auto-round: a tie gives the positive one)
            scale = torch.where(-xmin > xmax, -xmin, -xmax) / half
        zero = torch.full_like(scale, float(half))
    else:
        scale = (xmax - xmin) / maxq
        zero = None
    tiny = torch.finfo(SCALE_DTYPE).tiny
    scale = torch.where(scale.abs() > tiny, scale, torch.ones_like(scale))  # all-zero (or NaN) group: 1
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
                 bias: torch.Tensor | None = None, mse: bool = False, sym_range: str = "centred") -> QuantizedWeight:
    """Round-to-nearest with per-group min/max ranges (with `mse`, each group's range shrunk to the
    one with the lowest rounding error by `find_qparams`' coarse-to-fine search, as GPTQ's static
    groups are); vectorised over all groups at once."""
    n, k = weight.shape
    gs = k if group_size == -1 else group_size
    if k % gs:
        raise ValueError(f"group size {gs} does not divide in_features {k}")
    groups = k // gs
    w = weight.float().reshape(n * groups, gs)
    scale, zero = find_qparams(w, bits, sym, mse, sym_range=sym_range)
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


def fake_quantize_grouped(w: torch.Tensor, scheme, sym_range: str = "centred") -> torch.Tensor:
    """Quantize-dequantize ``w`` [N, K] per group with `grid`'s conventions (what rtn_quantize stores)."""
    n, k = w.shape
    gs = k if scheme.group_size == -1 else scheme.group_size
    wg = w.float().reshape(-1, gs)
    scale, zero = compute_qparams(wg, scheme.bits, scheme.sym, sym_range=sym_range)
    return fake_quantize(wg, scale, zero, scheme.bits).reshape(n, k).to(w.dtype)


def find_qparams(x: torch.Tensor, bits: int, sym: bool, mse: bool = False,
                 grid: int = MSE_GRID, maxshrink: float = MSE_MAXSHRINK, norm: float = MSE_NORM,
                 coarse_step: int = MSE_COARSE_STEP, sym_range: str = "centred",
                 importance: Optional[torch.Tensor] = None):
    """Scale/zero per row of x [rows, cols] (fp32 [rows] each), optionally with the reference
    MSE range-shrink search: shrink factors p = 1 - i/grid for i < maxshrink*grid.

    `importance` ([rows, cols] or [1, cols], >= 0) weighs each element's rounding error in the
    search: GPTQ passes its Hessian's diagonal (each input's mean square), so a row keeps the range
    that rounds the weights on the larger inputs best, which is what the layer's output error
    counts (llama.cpp's imatrix search does the same for its blocks). None: every element counts
    the same (the reference search).

    With coarse_step s > 1 the search first tries every s-th factor, then the s - 1 factors on each
    side of each row's best coarse one: (n/s + 2s - 2) trials instead of n (27 of 80 at s = 4).
    The error as a function of p is jagged (values cross rounding boundaries), so this can settle
    on a neighbouring local minimum; docs/defaults.yaml has what that costs in KL
    (nothing measurable) and saves in time. coarse_step=1 is the reference's exhaustive loop."""
    if not mse:
        return compute_qparams(x, bits, sym, sym_range=sym_range)
    x = x.float()
    n_p = int(maxshrink * grid)
    step = max(1, int(coarse_step))
    # row i tries shrink index idx[i, t]: first every step-th index for every row ...
    coarse = torch.arange(0, n_p, step, device=x.device).expand(x.shape[0], -1)
    err, scale, zero = _shrink_errors(x, coarse, bits, sym, grid, norm, sym_range, importance)
    best = err.argmin(dim=1)  # first minimum: the largest p wins ties, like the reference's strict <
    if step == 1:
        return _pick(scale, best), _pick(zero, best)
    # ... then the indices around each row's best coarse one (clamped to the range: repeats are harmless)
    centre = coarse.gather(1, best.unsqueeze(1))
    fine = (centre + torch.arange(-(step - 1), step, device=x.device)).clamp_(0, n_p - 1)
    err, scale, zero = _shrink_errors(x, fine, bits, sym, grid, norm, sym_range, importance)
    best = err.argmin(dim=1)
    return _pick(scale, best), _pick(zero, best)


def _pick(t: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return t.gather(1, j.unsqueeze(1)).squeeze(1)


# bytes of one row chunk's [rows, trials, cols] temporaries in the shrink search: a few MB stay in
# cache across its dozen elementwise passes (the demo's layers: ~4x faster than whole-trial slabs)
SHRINK_CHUNK_BYTES = 2 << 20


def _shrink_errors(x: torch.Tensor, idx: torch.Tensor, bits: int, sym: bool, grid: int, norm: float,
                   sym_range: str = "centred", importance: Optional[torch.Tensor] = None):
    """Rounding error sum |fake_quantize(x) - x|^norm of each row of x [rows, cols] on the range
    shrunk by p = 1 - idx/grid for every index in idx [rows, trials]; returns err, scale and zero,
    each [rows, trials]. Rows are evaluated a cache-sized chunk at a time, every trial at once."""
    rows, cols = x.shape
    trials = idx.shape[1]
    # compute_qparams only looks at each row's min and max, so a (min, max) stand-in gives the
    # identical scale/zero for every trial at once
    mm = torch.stack([x.amin(dim=1), x.amax(dim=1)], dim=1)
    p = (1.0 - idx.to(torch.float64) / grid).to(torch.float32)  # [rows, trials]
    scale, zero = compute_qparams(mm.repeat_interleave(trials, 0), bits, sym, clip_ratio=p.reshape(-1),
                                  sym_range=sym_range)
    scale, zero = scale.view(rows, trials), zero.view(rows, trials)
    maxq = max_code(bits)
    if sym:  # codes centred on the zero point: clamp(round(x/s), -z, maxq - z), the same values
        z = (maxq + 1) // 2
        if not bool((zero == z).all()):
            raise AssertionError("symmetric zero points must all be (maxq + 1) / 2")
    err = torch.empty(rows, trials, device=x.device)
    chunk = max(1, SHRINK_CHUNK_BYTES // (4 * trials * cols))
    for r0 in range(0, rows, chunk):
        xs = x[r0:r0 + chunk].unsqueeze(1)  # [r, 1, cols]
        s = scale[r0:r0 + chunk].unsqueeze(2)  # [r, trials, 1]
        q = torch.div(xs, s).round_()
        if sym:
            q.clamp_(-z, maxq - z)
        else:
            zc = zero[r0:r0 + chunk].unsqueeze(2)
            q.add_(zc).clamp_(0, maxq).sub_(zc)
        d = q.mul_(s).sub_(xs).abs_()
        # |d|**norm as exp(norm*log|d|): ~3x faster than pow on CPU, equal to a few ulp (0 -> 0)
        d = d.log_().mul_(norm).exp_()
        if importance is not None:
            d.mul_((importance if importance.shape[0] == 1 else importance[r0:r0 + chunk]).unsqueeze(1))
        err[r0:r0 + chunk] = d.sum(dim=2)
    return err, scale, zero
