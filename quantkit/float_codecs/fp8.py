"""FP8 (E4M3) weights with one float32 scale per tensor, per output channel, or per (rows x cols) block.

scale = absmax / 448 over the scale's region (a zero scale becomes float32's eps, as in compressed-tensors'
`calculate_qparams`), value = E4M3(w / scale).  Block scales cover a zero-padded copy of the weight, so
a weight whose sides are not multiples of the block gets ceil(N/rows) x ceil(K/cols) scales (the shape
compressed-tensors and vLLM expect).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.errors import QuantkitError
from quantkit.float_codecs import e4m3, scale_search

STRATEGIES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class Fp8Weight:
    values: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32: [1] tensor, [N, 1] channel, [ceil(N/r), ceil(K/c)] block
    strategy: str
    block_size: Optional[tuple[int, int]] = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.values.to(torch.float32) * _expand(self.scale, self)).to(dtype)

    def element_scale(self) -> torch.Tensor:
        """Each element's scale, [N, K]."""
        return _expand(self.scale, self).expand(self.values.shape)


def _expand(scale: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """The scale broadcast to one entry per weight element."""
    if w.strategy != "block":
        return scale
    rows, cols = w.block_size
    n, k = w.values.shape
    return scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:n, :k]


def scale_of_absmax(amax: torch.Tensor) -> torch.Tensor:
    """absmax / 448, a zero scale replaced by float32's eps.  The divisor is a tensor on amax's device:
    CUDA divides by a Python number as a multiplication by its reciprocal, one ulp off the true quotient
    (and off compressed-tensors') for some values."""
    scale = amax / torch.tensor(e4m3.MAX, dtype=torch.float32, device=amax.device)
    return _nonzero(scale)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)


def _searched(x: torch.Tensor, amax: torch.Tensor, region_dims: tuple[int, ...],
              importance: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The scale (shaped like `amax`, which broadcasts over x with the region's dims of size 1) among
    absmax / 448 times each clip ratio with the lowest squared E4M3 rounding error over its region."""
    ratios = torch.tensor(scale_search.FP8_CLIP_RATIOS, dtype=torch.float32, device=x.device)
    candidates = scale_of_absmax(amax.unsqueeze(0) * ratios.view(-1, *([1] * amax.ndim)))  # [T, *amax.shape]
    candidates[0] = scale_of_absmax(amax)  # candidate 0 is the absmax scale, computed exactly as without the search

    def nearest(y: torch.Tensor) -> torch.Tensor:
        return e4m3.to_e4m3(y).to(torch.float32)

    best = scale_search.lowest_error(x, candidates, nearest, reduce_dims=region_dims, importance=importance)
    return scale_search.take(candidates, best)


def quantize(weight: torch.Tensor, strategy: str, block_size: Optional[tuple[int, int]] = None,
             search: bool = False, importance: Optional[torch.Tensor] = None) -> Fp8Weight:
    """Round-to-nearest FP8 of a 2-D weight [N, K] under the given scale strategy. With `search`, each scale is
    absmax / 448 times the clip ratio (`scale_search.FP8_CLIP_RATIOS`) that rounds its region with the lowest
    squared error, each element's weighted by its column's `importance` [K] when given."""
    if strategy not in STRATEGIES:
        raise QuantkitError(f"FP8 weights take strategy tensor, channel or block, not {strategy!r}")
    if weight.ndim != 2:
        raise QuantkitError(f"FP8 quantization takes a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.to(torch.float32)
    imp = scale_search.column_weights(importance, 1, w.shape[1])  # [1, K]: one weight per input column
    if strategy == "tensor":
        scale = _searched(w, w.abs().amax().reshape(1, 1), (0, 1), imp).reshape(1) if search \
            else scale_of_absmax(w.abs().amax().reshape(1))
        expanded = scale
    elif strategy == "channel":
        amax = w.abs().amax(dim=1, keepdim=True)
        scale = _searched(w, amax, (1,), imp) if search else scale_of_absmax(amax)
        expanded = scale
    else:
        if block_size is None:
            raise QuantkitError("FP8 block quantization needs a block size (rows, cols), e.g. (128, 128)")
        rows, cols = block_size
        n, k = w.shape
        nb, kb = math.ceil(n / rows), math.ceil(k / cols)
        padded = torch.nn.functional.pad(w, (0, kb * cols - k, 0, nb * rows - n))
        blocks = padded.reshape(nb, rows, kb, cols)
        block_amax = blocks.abs().amax(dim=(1, 3))
        imp = None if imp is None else torch.nn.functional.pad(imp.reshape(k), (0, kb * cols - k)).view(1, 1, kb, cols)
        scale = _searched(blocks, block_amax.view(nb, 1, kb, 1), (1, 3), imp).view(nb, kb) if search \
            else scale_of_absmax(block_amax)
        expanded = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:n, :k]
    return Fp8Weight(e4m3.to_e4m3(w / expanded), scale, strategy, tuple(block_size) if block_size else None)
