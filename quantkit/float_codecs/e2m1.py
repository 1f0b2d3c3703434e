"""FP4 E2M1: 1 sign, 2 exponent, 1 mantissa bit; the 16 codes are +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}.

Code = magnitude index (0..7) | sign << 3, the order OCP MX and NVFP4 (and compressed-tensors' packing) use.
Rounding is to the nearest value, ties to the even code (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4), which is
what compressed-tensors' `cast_to_fp4` does; values beyond 6 saturate to 6.  The sign bit is the input's
(a small negative value becomes code 8, "-0"), as compressed-tensors packs it.
"""
from __future__ import annotations

import torch

MAX = 6.0
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes; at a tie the even code wins, so the boundary belongs to the
# lower code when that code is even (strict ">" to go up) and to the upper code when it is odd (">=").
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def encode(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (uint8, 0..15) of each element of `x` (already divided by its scale)."""
    a = x.abs().to(torch.float32)
    index = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for lower_code, midpoint in enumerate(_MIDPOINTS):
        up = a > midpoint if lower_code % 2 == 0 else a >= midpoint
        index += up.to(torch.uint8)
    return index | (torch.signbit(x).to(torch.uint8) << 3)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """The float32 value of each E2M1 code."""
    table = torch.tensor(MAGNITUDES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


_MAGNITUDES_T = torch.tensor(MAGNITUDES)
_MIDPOINTS_T = torch.tensor(_MIDPOINTS)
_UP_AT_TIE = torch.tensor(_MIDPOINTS[1::2])  # midpoints above an odd code: a tie rounds up to the even one


def nearest_value(x: torch.Tensor) -> torch.Tensor:
    """decode(encode(x)) in a few ops (the inner loop of GPTQ on FP4 grids): the nearest E2M1 value, same
    ties and saturation, float32."""
    a = x.abs().to(torch.float32)
    mids, ups, mags = (t.to(a.device) for t in (_MIDPOINTS_T, _UP_AT_TIE, _MAGNITUDES_T))
    index = torch.bucketize(a, mids) + torch.isin(a, ups)
    return torch.where(torch.signbit(x), -mags[index], mags[index])


def round_magnitudes_(a: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 `a` rounded to the nearest E2M1 magnitude in place (the values of `nearest_value`,
    same ties and saturation): E2M1 keeps one mantissa bit, so a magnitude in [2^e, 2^(e+1)) rounds on a step of
    2^(e-1) (0.5 below 2, where the subnormal 0.5 shares the step), half to even, then saturates at 6. Fewer
    passes over memory than `nearest_value`'s table lookups: the bulk path (activations, ~2x faster)."""
    _, exponent = torch.frexp(a)  # a = m * 2^exponent, m in [0.5, 1): floor(log2 a) = exponent - 1
    step = exponent.sub_(1).clamp_(min=0).to(torch.float32).exp2_().mul_(0.5)
    return a.div_(step).round_().mul_(step).clamp_(max=MAX)


# rows rounded at once by `fake_quantize_groups`: the temporaries stay cache-sized (4x faster than whole)
FAKE_QUANTIZE_ROWS = 256


def fake_quantize_groups(x: torch.Tensor, group_size: int, step_of) -> torch.Tensor:
    """E2M1 elements of a 2-D `x` [N, K] in groups of `group_size` along K, rounded and scaled back (float32), a few
    hundred rows at a time: the activation round trip of the FP4 formats without their codes. `step_of(groups,
    rows)` gives each group's scale [r, K/group_size, 1] for `groups` [r, K/group_size, group_size] (float32, x's
    rows `rows`), so NVFP4 and MXFP4 differ only in it."""
    n, k = x.shape
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for start in range(0, n, FAKE_QUANTIZE_ROWS):
        rows = slice(start, start + FAKE_QUANTIZE_ROWS)
        groups = x[rows].to(torch.float32).reshape(-1, k // group_size, group_size)
        step = step_of(groups, rows)
        rounded = out[rows].view(groups.shape)
        torch.abs(groups, out=rounded)
        round_magnitudes_(rounded.div_(step)).mul_(step).copysign_(groups)
    return out
