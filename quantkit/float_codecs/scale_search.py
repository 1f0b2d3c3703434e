"""The range search of round-to-nearest on the float grids (#47 item 3): per scale region, a few candidate
scales, the one with the lowest squared rounding error kept.

The plain rule (absmax over the region's largest grid value) wastes precision on outliers: a group whose
largest weight is 3x its second rounds every other weight on a coarse step.  As quantkit's integer range
search does (`quantizers.grid.find_qparams`), trying a slightly smaller scale and keeping whichever rounds the
region best lowers the weight error, without data.  The candidates are the format's own scale values, so the
file still holds exactly what the format defines:
  NVFP4  the group's E4M3 scale and its E4M3 neighbours (codes +1, -1, -2, -3: about x1.1 down to x0.7)
  MXFP4  the group's E8M0 exponent e and e - 1 (half the step: the largest weights saturate at 6)
  FP8    the channel's / block's / tensor's absmax / 448 times clip ratios `FP8_CLIP_RATIOS`
The absmax scale is always candidate 0 and ties keep it, so the search never raises the error.
GPTQ weighs each element's error by its input column's importance (the Hessian's diagonal, `column_weights`),
so a region keeps the scale that rounds the weights on the large inputs best.

Whether each format uses it by default (`DEFAULT_ON`) follows the KL measured side by side on lee and wiki
(docs/float-schemes.md, scripts/bench_float_schemes.py): on only where it lowered KL on both.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from quantkit.errors import QuantkitError
from quantkit.scheme_presets import QuantArgs

NVFP4_CODE_OFFSETS = (0, 1, -1, -2, -3)
MXFP4_EXPONENT_OFFSETS = (0, -1)
FP8_CLIP_RATIOS = (1.0, 0.975, 0.95, 0.925, 0.9, 0.85, 0.8)

# format -> search on by default: on only where the bench measured lower KL on both lee and wiki
# (docs/float-schemes.md; NVFP4A16 RTN on the demo: 0.892x / 0.911x llm-compressor's absmax RTN KL on lee / wiki);
# MXFP4A16: 1.010x / 0.938x, not lower on both, so off; off where it is not measured yet (FP8)
DEFAULT_ON = {"nvfp4": True, "mxfp4": False, "fp8": False, "mxfp8": False}  # MXFP8: no search (float_codecs.mxfp8)
# GPTQ's own default (its search weighted by the Hessian's diagonal): MXFP4A16 GPTQ on the demo measured
# 0.1492 / 0.2595 with it against 0.1759 / 0.2777 without (lower on both; docs/float-schemes.md); FP8 unmeasured
GPTQ_DEFAULT_ON = {"nvfp4": True, "mxfp4": True, "fp8": False, "mxfp8": False}


def family(weights: QuantArgs) -> str:
    """"fp8", "mxfp8", "nvfp4" or "mxfp4": the float format of these weights args."""
    if weights.kind != "float" or weights.bits not in (4, 8):
        raise QuantkitError(f"no float range search for {weights.kind} {weights.bits}-bit weights")
    if weights.bits == 8:
        return "mxfp8" if weights.strategy == "group" else "fp8"
    return "nvfp4" if weights.strategy == "tensor_group" else "mxfp4"


def enabled(weights: QuantArgs, search: Optional[bool], defaults: Optional[dict] = None) -> bool:
    """Whether to search: `search` when the caller chose (an `mse` option), else the format's default in
    `defaults` (round-to-nearest's `DEFAULT_ON` unless given: GPTQ passes `GPTQ_DEFAULT_ON`)."""
    if search is None:
        return (DEFAULT_ON if defaults is None else defaults)[family(weights)]
    if not isinstance(search, bool):
        raise QuantkitError(f"option mse={search!r} must be true or false (default: the format's, {DEFAULT_ON})")
    return search


def e2m1_magnitude(y: torch.Tensor) -> torch.Tensor:
    """The nearest E2M1 magnitude of |y| (steps 0.5 below 2, 1 below 4, then 4 or 6; saturating at 6) in a few
    ops, for the search's error only: at an exact tie it may take the other neighbour than `e2m1.encode`'s
    ties-to-even, which is as far away, so every error (and the scale chosen) is the same."""
    a = y.to(torch.float32).abs().clamp_(max=6.0).contiguous()
    # the step is 2**(floor(log2 a) - 1) clamped to [0.5, 2]: a's float32 exponent field minus one, clamped to
    # 126..128, is the step's own bit pattern (2.7x faster on one core than nested torch.where with scalars;
    # the search calls this once per candidate and element). Relies on float32 bits: `a` is float32 above.
    exponent = a.view(torch.int32).bitwise_right_shift(23)  # biased; the sign bit is 0 after abs
    step = exponent.sub_(1).clamp_(126, 128).bitwise_left_shift_(23).view(torch.float32)
    return a.div(step).round_().mul_(step)


def column_weights(importance: Optional[torch.Tensor], *shape: int) -> Optional[torch.Tensor]:
    """A weight's per-input-column `importance` [K] (>= 0; GPTQ's Hessian diagonal) reshaped to `shape`, the
    view that broadcasts over the search's regions (e.g. [1, G, 16] for NVFP4's [N, G, 16] groups). None stays
    None."""
    if importance is None:
        return None
    if importance.numel() != int(torch.tensor(shape).prod()):
        raise QuantkitError(f"an importance of {importance.numel()} input columns does not fit the view {shape}")
    return importance.to(torch.float32).clamp(min=0).reshape(shape)


def lowest_error(x: torch.Tensor, steps: torch.Tensor, round_to_grid: Callable[[torch.Tensor], torch.Tensor],
                 reduce_dims: tuple[int, ...], importance: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Index (into the first axis of `steps`) of the candidate step with the lowest sum of squared rounding
    error of `x`, per region. `steps` [T, *shape broadcastable to x]; `round_to_grid(y)` the nearest grid
    value of y (E4M3, saturating; or `e2m1_magnitude`, with x the magnitudes); `reduce_dims` the dims of x
    one region spans; `importance` (broadcastable to x with a first dim of 1: `column_weights`) weighs each
    element's squared error. The first minimum wins, so candidate 0 (the absmax scale) is kept on a tie. The
    reduced dims are kept (size 1)."""
    if importance is not None and importance.shape[0] != 1:  # the row slabs below rely on it
        raise QuantkitError("the search's importance must broadcast over x's first dim (shape [1, ...])")
    dims = tuple(d % x.ndim for d in reduce_dims)
    if 0 in dims:  # one region spans the first dim (FP8 per tensor): a candidate at a time
        errors = [_squared_error(x, step, round_to_grid, dims, importance) for step in steps]
        return torch.stack(errors).argmin(dim=0)
    # every candidate at once ([T, rows, ...]: few, large ops, which a busy machine schedules far better than
    # many small ones), a slab of rows at a time so that the temporaries stay near CANDIDATE_CHUNK_ELEMENTS
    t = steps.shape[0]
    rows = max(1, CANDIDATE_CHUNK_ELEMENTS // max(1, t * x[0].numel()))
    out = []
    for r0 in range(0, x.shape[0], rows):
        xs = x[r0:r0 + rows]
        st = steps[:, r0:r0 + rows] if steps.shape[1] > 1 else steps
        out.append(_squared_error(xs.unsqueeze(0), st, round_to_grid, tuple(d + 1 for d in dims), importance)
                   .argmin(dim=0))
    return torch.cat(out)


CANDIDATE_CHUNK_ELEMENTS = 1 << 24  # 64 MB of float32 per temporary


def _squared_error(x: torch.Tensor, step: torch.Tensor, round_to_grid, dims: tuple[int, ...],
                   importance: Optional[torch.Tensor] = None) -> torch.Tensor:
    d = round_to_grid(x / step).mul_(step).sub_(x).square_()
    if importance is not None:
        d.mul_(importance)
    return d.sum(dim=dims, keepdim=True)


def take(candidates: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """candidates [T, *shape] at `index` [*shape] (from `lowest_error`, which keeps the reduced dims)."""
    return candidates.gather(0, index.unsqueeze(0)).squeeze(0)
