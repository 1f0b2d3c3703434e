"""Round-to-nearest onto a float preset's grid as a step of quantkit's layer-by-layer pipeline.

Why a step: a model too big for memory is quantized layer by layer from its files (`--streaming`, quantkit.streaming),
and only the pipeline holds one layer at a time and keeps each finished layer in the progress store for the writer
(and `--resume`). A model held in memory is rounded by `float_checkpoint` directly, linear by linear; this step
gives the same weight objects (`float_codecs.fixed_grid`'s round-to-nearest: the codecs and range-search default
`float_checkpoint.quantize_weight` uses, NVFP4's fused siblings sharing one global scale), so a streamed run
writes the same bytes.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from quantkit.float_codecs.fixed_grid import fixed_grid
from quantkit.float_codecs.fused_global_scale import shared_global_scales
from quantkit.float_codecs.result import FloatResult
from quantkit.quantizers.base import LayerContext, Quantizer
from quantkit.scheme import LinearScheme
from quantkit.scheme_presets import SchemePreset


class FloatRTN(Quantizer):
    """Round-to-nearest on `preset`'s weight grid, with the scales' range search `mse` (None: the format's
    default, as `float_checkpoint.write` rounds). Not a registered method: the float writer builds it."""

    name = "rtn"
    needs_calibration = False
    observes = False
    options_spec = {"mse": None}

    def __init__(self, preset: SchemePreset, **options):
        super().__init__(**options)
        self.preset = preset
        self._global_scales: dict[str, torch.Tensor] = {}

    def begin_layer(self, ctx: LayerContext) -> None:
        # NVFP4: fused siblings (q/k/v, gate/up) share one global scale, from the layer's original weights
        self._global_scales = (shared_global_scales(ctx.layer, set(ctx.schemes))
                               if self.preset.weights.strategy == "tensor_group" else {})

    def quantize_linear(self, name: str, module: nn.Linear, scheme: LinearScheme) -> FloatResult:
        return self._rounded(name, module)

    def quantize_uncalibrated(self, name: str, module: nn.Linear, scheme: LinearScheme) -> FloatResult:
        return self._rounded(name, module)

    def round_to_nearest(self, module: nn.Linear, scheme: LinearScheme) -> FloatResult:
        return self._rounded("", module)

    def _rounded(self, name: str, module: nn.Linear) -> FloatResult:
        bias: Optional[torch.Tensor] = None if module.bias is None else module.bias.detach().clone()
        grid = fixed_grid(module.weight.detach(), self.preset.weights, self._global_scales.get(name),
                          search=self.options["mse"])
        return FloatResult(grid.rtn, bias)

    def end_layer(self, ctx: LayerContext) -> None:
        self._global_scales = {}
