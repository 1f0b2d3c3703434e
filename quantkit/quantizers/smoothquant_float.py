"""SmoothQuant before a float preset with quantized activations (NVFP4, FP8, MXFP4, W4AFP8), as a pass of its own.

Why: a preset that quantizes input activations (FP4 groups of 16, FP8 per token or per tensor) loses most where
a few input channels carry outliers. SmoothQuant's per-channel scale moves part of that range into the weight
columns and divides it out of the norm before them, which is exact in full precision (`models.folding`). The
float presets' writer (`float_checkpoint.write` with method `smoothquant` or `smoothquant+gptq`) runs this pass
first, then measures static input scales and quantizes the smoothed model as it would any other.

`FloatSmoothing` is `SmoothQuantTransform` with the preset's grids in its alpha search: each candidate's block
output is computed with the smoothed weights rounded to nearest on the preset's weight grid (the format's scales,
`float_codecs.fixed_grid`, or the integer groups of W4AFP8) and the inputs fake-quantized as the runtime does
(`float_codecs.activations`; static scales from the smoothed calibration maximum, as the writer will store).
"No smoothing" is a candidate too (alpha None, scales of 1), and a tie keeps it, so the search smooths a group
only where the simulated checkpoint's block output gets closer to full precision. The pass itself is
`float_passes.run_pass`: it quantizes nothing.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.float_codecs import activations
from quantkit.float_codecs.fixed_grid import fixed_grid
from quantkit.float_codecs.input_scales import input_scale_for
from quantkit.quantizers import float_passes
from quantkit.quantizers.grid import fake_quantize_grouped
from quantkit.quantizers.smoothquant import SmoothQuantTransform
from quantkit.scheme import LinearScheme
from quantkit.scheme_presets import SchemePreset

# SmoothQuant's options that mean something before a float preset ("activations" is the preset's to say)
OPTIONS = ("smooth", "alpha", "alpha_step", "search_tokens")


class FloatSmoothing(float_passes.PresetTransform, SmoothQuantTransform):
    """SmoothQuant whose alpha search simulates `preset`'s weight and activation grids (module docstring)."""

    name = "smoothquant"

    def __init__(self, preset: SchemePreset, **options):
        if preset.input_activations is None:
            raise QuantkitError(f"--scheme {preset.name} quantizes weights only: SmoothQuant moves activation range "
                                "into the weights, which helps only where activations are quantized; drop "
                                "smoothquant from --method (gptq alone, or a scheme with quantized activations)")
        super().__init__(**options)
        self.preset = preset
        self.observes = False  # the writer measures static input scales itself, after this pass
        self.needs_calibration = True
        w = preset.weights
        self._int_scheme = (LinearScheme(bits=w.bits, group_size=w.group_size if w.strategy == "group" else -1,
                                         sym=w.symmetric) if w.kind == "int" else None)

    def finalize(self, name: str, qw):
        return qw

    def _alphas(self) -> list:
        return [None] + super()._alphas()  # None: leave the group unsmoothed (first, so a tie keeps it)

    def _scales(self, x_max: torch.Tensor, w_max: torch.Tensor, alpha) -> torch.Tensor:
        if alpha is None:
            return torch.ones_like(x_max, dtype=torch.float32)
        return super()._scales(x_max, w_max, alpha)

    def _fake_weight(self, name: str, w: torch.Tensor) -> torch.Tensor:
        if self._int_scheme is not None:
            return fake_quantize_grouped(w, self._int_scheme)
        return fixed_grid(w, self.preset.weights).rtn.dequantize()

    def _fake_input(self, name: str, x: torch.Tensor, amax: float) -> torch.Tensor:
        static = input_scale_for(self.preset.input_activations, torch.tensor(amax, dtype=torch.float32))
        return activations.fake_quantize(x, self.preset.input_activations, None if static is None else static[1])


PASS = float_passes.register(float_passes.FloatPass(
    "smoothquant", FloatSmoothing, OPTIONS,
    reasons=(("activations", "--scheme {preset} sets its own input activations; drop the activations option"),)))


def smooth(model: nn.Module, preset: SchemePreset, linears: list[str], calibration: Optional[torch.Tensor],
           options: dict, batch_size: int = 8, progress: bool = False) -> dict[int, list[dict]]:
    """Smooth `model` in place for `preset` (the groups feeding any of `linears`), layer by layer on `calibration`
    (token ids); returns the search log per decoder layer (each group's alpha, None where it stayed unsmoothed,
    and, for alpha auto, the loss of every candidate)."""
    return float_passes.run_pass(model, preset, PASS, linears, calibration, options, batch_size, progress).search_log
