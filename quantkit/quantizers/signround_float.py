"""SignRound's tuned state for a linear on an FP4 grid (NVFP4, MXFP4): what `signround.TunedLinear` is for
integer grids, so the same signed-gradient loop refines float GPTQ's results (#47, `--scheme NVFP4A16 --method
gptq,signround`).

Why a twin and not a branch: the grid is not uniform. An E2M1 element takes the values +-{0, .5, 1, 1.5, 2,
3, 4, 6} times its group's step, so "one code up" is not "+1", and the scales are the format's own: NVFP4's
E4M3 group scales under the tensor's global scale, MXFP4's power-of-two (E8M0) exponents. Per target linear,
with the quantizer's values q (E2M1, in units of the step), its steps s and the unquantized weight W:

    step'  = E4M3(s_group * global * a) / global     a: one factor per group, in `scale_range` (NVFP4 only)
    value  = E2M1(clamp(q + p + W/step' - W/s + V, -6, 6))     V: one per weight, |V| <= `offset_range`
    W_q    = step' * value

E4M3 and E2M1 rounding go through straight-through estimators (auto-round's NVFP4 / MXFP4 rounding adds V
to w / scale the same way). p is where round-to-nearest put the weight inside its own bin, carried into q's
bin (kept strictly inside it), as the integer start does, so at V = 0, a = 1 the start *is* the quantizer's
solution, bit for bit. MXFP4's exponents are not tuned: a factor within [0.8, 1.25] never moves a power of
two, so the scale's gradient would only be noise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.float_codecs import e2m1, e4m3, e8m0
from quantkit.float_codecs.mxfp4 import Mxfp4Weight
from quantkit.float_codecs.nvfp4 import Nvfp4Weight
from quantkit.float_codecs.result import FloatResult

_VALUES = torch.tensor(sorted({s * m for m in e2m1.MAGNITUDES for s in (-1.0, 1.0)}))  # the 15 distinct values
_INSIDE = 1e-3  # how far inside its bin a start position stays (in units of the step)
_SMALLEST_E4M3 = 2.0 ** -9  # the smallest positive E4M3 value: a tuned group scale never rounds to zero


def bin_edges(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lower, upper) edges of each E2M1 value's start bin: the midpoints to its neighbours, and +-6 itself
    for +-6 (a start beyond the grid's end would sit where the clamp before rounding passes no gradient,
    so the steps could never move it), so a position strictly between them rounds to the value."""
    v = _VALUES.to(values.device)
    index = torch.bucketize(values, v)  # the value's own index (values are on the grid)
    mids = torch.cat([v[:1], (v[1:] + v[:-1]) / 2, v[-1:]])
    return mids[index], mids[index + 1]


@dataclass
class TunedFloatLinear:
    """One FP4 linear's tuning state (see the module docstring); the interface of `signround.TunedLinear`."""

    name: str  # relative to the layer
    start_result: FloatResult  # the quantizer's result (kept: its bias, stats and input absmax carry over)
    weight: torch.Tensor  # the unquantized weight [N, K], fp32
    group: int  # elements per scale (NVFP4 16, MXFP4 32)
    base: torch.Tensor  # NVFP4: the E4M3 group scales as float32 [N, G]; MXFP4: the groups' steps
    global_scale: torch.Tensor | None  # NVFP4's (float32 [1]); None for MXFP4
    start: torch.Tensor  # q plus the position inside its bin [N, K]
    weight_over_step: torch.Tensor  # W / s [N, K]
    offset: torch.Tensor  # V [N, K]
    factor: torch.Tensor  # a [N, G]

    @property
    def tunes_scales(self) -> bool:
        return self.global_scale is not None

    @classmethod
    def start_from(cls, name: str, result: FloatResult, weight: torch.Tensor, device,
                   start_position: str = "rtn") -> "TunedFloatLinear":
        w = result.weight
        if isinstance(w, Nvfp4Weight):
            group, base, gscale = 16, w.group_scale.to(torch.float32), w.global_scale.to(torch.float32).reshape(1)
            step = base / gscale
        elif isinstance(w, Mxfp4Weight):
            group, base, gscale = 32, e8m0.decode(w.scale_codes), None
            step = base
        else:
            raise QuantkitError(f"signround tunes 4-bit float grids (NVFP4, MXFP4); {name} is {type(w).__name__}: "
                                "drop signround for the 8-bit presets, whose round-to-nearest error is already small")
        codes = w.codes.to(device)
        q = e2m1.decode(codes)
        weight = weight.detach().to(device=device, dtype=torch.float32)
        step_elem = step.to(device).repeat_interleave(group, dim=1)
        over = weight / step_elem
        within = over - e2m1.nearest_value(over)
        if start_position == "centre":
            within.zero_()
        lower, upper = bin_edges(q)
        start = torch.minimum(torch.maximum(q + within, lower + _INSIDE), upper - _INSIDE)
        if not torch.equal(e2m1.nearest_value(start), q):
            raise QuantkitError(f"signround's start for {name} does not round to the quantizer's values; this is a bug")
        return cls(name=name, start_result=result, weight=weight, group=group, base=base.to(device),
                   global_scale=None if gscale is None else gscale.to(device), start=start, weight_over_step=over,
                   offset=torch.zeros_like(weight), factor=torch.ones_like(base, device=device))

    def steps(self, factor: torch.Tensor) -> torch.Tensor:
        """Each group's step [N, G]: NVFP4's tuned group scale rounded to E4M3 (straight-through) under the
        global scale; MXFP4's power of two as it is."""
        if self.global_scale is None:
            return self.base
        scale = self.group_scale(factor)
        scale = scale + (e4m3.to_e4m3(scale).to(torch.float32) - scale).detach()
        return scale / self.global_scale

    def group_scale(self, factor: torch.Tensor) -> torch.Tensor:
        """NVFP4's tuned group scales before their E4M3 rounding, within E4M3's positive range."""
        return (self.base * factor).clamp(_SMALLEST_E4M3, e4m3.MAX)

    def values(self, step: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """E2M1 values in units of the step, rounding straight-through."""
        x = (self.start + (self.weight / step - self.weight_over_step) + offset).clamp(-e2m1.MAX, e2m1.MAX)
        return x + (e2m1.nearest_value(x) - x).detach()

    def dequantized(self, factor: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        step = self.steps(factor).repeat_interleave(self.group, dim=1)
        return step * self.values(step, offset)

    @torch.no_grad()
    def result(self, factor: torch.Tensor, offset: torch.Tensor) -> FloatResult:
        """The FloatResult of these parameters (on the CPU), checked to dequantize to what was tuned."""
        step = self.steps(factor)
        codes = e2m1.encode(self.values(step.repeat_interleave(self.group, dim=1), offset))
        old = self.start_result
        if self.global_scale is None:
            weight = Mxfp4Weight(codes.cpu(), old.weight.scale_codes)
        else:
            scale = e4m3.to_e4m3(self.group_scale(factor))
            weight = Nvfp4Weight(codes.cpu(), scale.cpu(), old.weight.global_scale)
        if not torch.equal(weight.dequantize().to(self.weight.device), self.dequantized(factor, offset)):
            raise QuantkitError(f"signround's tuned {self.name} does not encode back to itself; this is a bug")
        return FloatResult(weight, old.bias, {**old.stats, "refined": "signround"}, old.input_absmax)
