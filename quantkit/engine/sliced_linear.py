"""Plain fp32 linears of a decode step on CPU, their output rows split across threads, bit-equal.

Why: in fp32 on CPU, ``F.linear`` of one to a few rows is MKL's matrix-vector path, which runs on one
core whatever the thread count, so a decode step streams its weights at one core's memory bandwidth
(the demo's 49k x 576 LM head alone is 113 MB per token, ~10 ms). Viewed as [P, out / P, in]
slices, the same product is one ``bmm`` whose P matrix-vector products PyTorch runs on its P threads,
each the same MKL call on a slice: 1.4-2x faster on two cores and, where each output's dot product
does not depend on which other rows are computed with it, bit-equal. That is the BLAS's choice, not a
law (here 1-4 rows are, 6 rows are not), so each (shape, bias) is checked against ``F.linear`` on a
probe of every split row count, once, and a linear that differs in any stays a plain call. A bf16
linear already runs threaded (oneDNN), and so does MKL's GEMM for more rows: both stay plain.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

MAX_ROWS = 4  # rows per call that are split; more go to the (threaded) whole product
MIN_SLICE = 1 << 15  # weight elements per slice (128 KB in fp32): a smaller slice's set-up costs more than
# its thread gains


class SlicedLinear:
    """``x [M, in] -> [M, out]`` as ``F.linear(x, weight, bias)``, for a row-major x of M <= MAX_ROWS
    rows as one ``bmm`` (``baddbmm`` with a bias) over `parts` slices of the output rows (`parts`
    divides out)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], parts: int):
        out_features, in_features = weight.shape
        self.weight, self.bias, self.parts = weight, bias, parts
        self.slices = weight.view(parts, out_features // parts, in_features).transpose(1, 2)  # [P, in, out / P]
        self.bias_slices = None if bias is None else bias.view(parts, 1, out_features // parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        row_major = x.dim() == 2 and x.stride() == (x.shape[1], 1)  # F.linear's rounding follows x's strides
        if not row_major or x.shape[0] > MAX_ROWS or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        m = x.shape[0]
        xs = x.expand(self.parts, m, x.shape[1])
        if self.bias_slices is None:
            y = torch.bmm(xs, self.slices)  # [P, M, out / P]
        else:
            y = torch.baddbmm(self.bias_slices.expand(self.parts, m, -1), xs, self.slices)
        return y.transpose(0, 1).reshape(m, self.weight.shape[0])


_probed: dict[tuple, bool] = {}  # (out, in, has bias, parts) -> whether slicing is exact


def slicing_is_exact(sliced: SlicedLinear) -> bool:
    """Whether `sliced` gives ``F.linear``'s result bit for bit for every split row count, on random
    rows. Probed once per (shape, bias, parts), on the first weight seen with them: the BLAS's
    summation order follows the shapes, not the values."""
    key = (*sliced.weight.shape, sliced.bias is not None, sliced.parts)
    if key not in _probed:
        gen = torch.Generator().manual_seed(0)
        rows = [torch.randn(m, sliced.weight.shape[1], generator=gen) for m in range(1, MAX_ROWS + 1)]
        _probed[key] = all(torch.equal(sliced(x), F.linear(x, sliced.weight, sliced.bias)) for x in rows)
    return _probed[key]


def slice_count(out_features: int, in_features: int, threads: int) -> int:
    """How many slices to cut: up to one per thread, each at least MIN_SLICE elements, dividing the
    output rows (1: do not slice)."""
    for parts in range(min(threads, out_features * in_features // MIN_SLICE), 1, -1):
        if out_features % parts == 0:
            return parts
    return 1


def linear_fn(weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
              threads: Optional[int] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``F.linear`` with `weight` and `bias`, as the engine calls it: a SlicedLinear where that is
    exact and pays (fp32 on CPU, large enough, two threads or more), else the plain call."""
    parts = slice_count(*weight.shape, threads or torch.get_num_threads())
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and parts > 1 and weight.is_contiguous() \
            and (bias is None or bias.dtype == weight.dtype and bias.is_contiguous()):
        sliced = SlicedLinear(weight.detach(), None if bias is None else bias.detach(), parts)
        if slicing_is_exact(sliced):
            return sliced
    return functools.partial(F.linear, weight=weight, bias=bias)
