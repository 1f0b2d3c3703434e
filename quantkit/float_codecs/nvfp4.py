"""NVFP4: E2M1 elements in groups of 16, each group with an FP8 E4M3 scale, under one float32 global scale.

As compressed-tensors 0.20.1 defines it (`generate_gparam`, `calculate_qparams`, `forward._quantize`):
    global_scale = 448 * 6 / absmax(W)                      (1.0 when that is not finite)
    group_scale  = E4M3(global_scale * (absmax(group) / 6)) (0 becomes 0.125, E4M3's eps there)
    code         = E2M1(w / (group_scale / global_scale))
    w_hat        = e2m1(code) * group_scale / global_scale
The global scale stretches the groups' scales over E4M3's range, so small groups keep precision.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.float_codecs import e2m1, e4m3, scale_search

GROUP_SIZE = 16


@dataclass(frozen=True)
class Nvfp4Weight:
    codes: torch.Tensor  # uint8 [N, K], E2M1 codes 0..15
    group_scale: torch.Tensor  # float8_e4m3fn [N, K/16]
    global_scale: torch.Tensor  # float32 [1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        step = self.group_scale.to(torch.float32) / self.global_scale.to(torch.float32)
        n, k = self.codes.shape
        values = e2m1.decode(self.codes).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        return (values * step.unsqueeze(-1)).reshape(n, k).to(dtype)


@torch.no_grad()  # as the codec's: rounding has no gradient (the codes are integers)
def fake_quantize(x: torch.Tensor, gscale: torch.Tensor) -> torch.Tensor:
    """quantize(x, gscale).dequantize() of a 2-D `x` (an activation under its input global scale), value for
    value (the same operations on every scale), without the codes (`e2m1.fake_quantize_groups`): what a runtime's
    W4A4 input rounding gives, at a fraction of the codec's cost. `gscale` is one scale [1] or one per row
    [N, 1] (each row then as if quantized alone under its own)."""
    check_grouped_shape(x, GROUP_SIZE, "NVFP4")
    n = x.shape[0]
    gscale = gscale.to(device=x.device, dtype=torch.float32)
    if gscale.numel() != 1 and tuple(gscale.shape) != (n, 1):
        raise ValueError(f"NVFP4 global scales of shape {tuple(gscale.shape)} for {n} rows; give [1] or [{n}, 1]")
    per_row = gscale.numel() != 1
    six, eps = (torch.tensor(v, device=x.device) for v in (e2m1.MAX, 0.125))

    def step_of(groups: torch.Tensor, rows: slice) -> torch.Tensor:
        g = gscale[rows] if per_row else gscale.reshape(1, 1)
        scale = e4m3.to_e4m3(groups.abs().amax(dim=-1).div_(six).mul_(g)).to(torch.float32)
        return torch.where(scale == 0, eps, scale).div_(g).unsqueeze(-1)

    return e2m1.fake_quantize_groups(x, GROUP_SIZE, step_of)


def _scale_of_absmax(amax: torch.Tensor) -> torch.Tensor:
    """448 * 6 / amax (amax at least float32's tiny), 1.0 where that is not finite: `generate_gparam`'s rule."""
    scale = e4m3.MAX * e2m1.MAX / amax.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0)


def row_global_scales(x: torch.Tensor) -> torch.Tensor:
    """`global_scale`'s rule for each row of a 2-D `x` alone, [N, 1]."""
    return _scale_of_absmax(x.to(torch.float32).abs().amax(dim=1, keepdim=True))


def global_scale(weight: torch.Tensor) -> torch.Tensor:
    return _scale_of_absmax(weight.to(torch.float32).abs().amax()).reshape(1)


def check_grouped_shape(weight: torch.Tensor, group_size: int, name: str) -> None:
    if weight.ndim != 2 or weight.shape[1] % group_size:
        raise QuantkitError(f"{name} needs a 2-D weight whose input size is a multiple of {group_size}, "
                            f"got shape {tuple(weight.shape)}; leave this layer unquantized (--ignore)")


def quantize(weight: torch.Tensor, gscale: torch.Tensor | None = None, search: bool = False,
             importance: torch.Tensor | None = None) -> Nvfp4Weight:
    """Round-to-nearest NVFP4 of a 2-D weight [N, K] (K a multiple of 16), under `gscale` when given (an
    activation's calibrated input_global_scale), else the weight's own `global_scale`. With `search`, each
    group's E4M3 scale is the one among its absmax scale and that scale's E4M3 neighbours that rounds the group
    with the lowest squared error (`scale_search`), each element's weighted by its column's `importance` [K] when
    given (GPTQ passes its Hessian's diagonal: the error the layer's output sees)."""
    check_grouped_shape(weight, GROUP_SIZE, "NVFP4")
    w = weight.to(torch.float32)
    n, k = w.shape
    groups = w.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    gscale = global_scale(w) if gscale is None else gscale.to(device=w.device, dtype=torch.float32).reshape(1)
    # a tensor divisor on the weight's device: CUDA turns division by a Python number into a reciprocal multiply
    local = gscale * (groups.abs().amax(dim=-1) / torch.tensor(e2m1.MAX, device=w.device))
    scale = e4m3.to_e4m3(local).to(torch.float32)
    if search:
        imp = scale_search.column_weights(importance, 1, *groups.shape[1:])
        scale = _searched_group_scales(groups, scale, gscale, imp)
    scale = torch.where(scale == 0, torch.tensor(0.125, device=w.device), scale)
    codes = e2m1.encode(groups / (scale / gscale).unsqueeze(-1))
    return Nvfp4Weight(codes.reshape(n, k), scale.to(e4m3.DTYPE), gscale)


def _searched_group_scales(groups: torch.Tensor, scale: torch.Tensor, gscale: torch.Tensor,
                           importance: torch.Tensor | None = None) -> torch.Tensor:
    """Each group's E4M3 scale (float32 [N, G]) chosen among `scale` (the absmax one) and its E4M3 neighbours
    (code offsets `scale_search.NVFP4_CODE_OFFSETS`, kept within 2**-9 .. 448): the lowest squared error of
    the group rounded under it."""
    code = scale.to(e4m3.DTYPE).view(torch.uint8).to(torch.int16)  # scales are >= 0: the code orders them
    offsets = torch.tensor(scale_search.NVFP4_CODE_OFFSETS, dtype=torch.int16, device=code.device)
    codes = (code.unsqueeze(0) + offsets.view(-1, 1, 1)).clamp(1, 0x7E)
    codes[0] = code  # candidate 0 is the absmax scale itself, zero included
    candidates = codes.to(torch.uint8).view(e4m3.DTYPE).to(torch.float32).unsqueeze(-1)  # [T, N, G, 1]
    steps = torch.where(candidates == 0, torch.ones_like(candidates), candidates) / gscale
    best = scale_search.lowest_error(groups.abs(), steps, scale_search.e2m1_magnitude, reduce_dims=(-1,),
                                     importance=importance)
    return scale_search.take(candidates, best).squeeze(-1)
