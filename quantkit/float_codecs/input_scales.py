"""The static input scales a float preset's checkpoint stores, from each linear's calibrated input absmax.

As compressed-tensors 0.20.1 computes them from its "static_minmax" observer (a running min/max over every
calibration batch, so the absmax of all inputs a linear saw):
    FP8   input_scale        = absmax / 448          (`calculate_qparams`; a zero scale becomes float32's eps)
    NVFP4 input_global_scale = 448 * 6 / absmax      (`generate_gparam`; 1.0 when that is not finite)
Both are stored as compressed-tensors stores them and vLLM reads them: the FP8 scale divides the input
(x / input_scale, rounded to E4M3), the NVFP4 global scale multiplies it (vLLM takes its reciprocal at load,
`CompressedTensorsW4A4Fp4.process_weights_after_loading`). float32, shape [1].
"""
from __future__ import annotations

import torch

from quantkit.float_codecs import fp8, nvfp4
from quantkit.scheme_presets import QuantArgs

FP8_INPUT_SCALE = "input_scale"
NVFP4_INPUT_GLOBAL_SCALE = "input_global_scale"


def tensor_name(acts: QuantArgs) -> str | None:
    """The tensor a calibrated activation scheme stores (None for dynamic activations, which store none)."""
    if acts.dynamic is True:
        return None
    if (acts.kind, acts.bits, acts.strategy, acts.dynamic) == ("float", 8, "tensor", False):
        return FP8_INPUT_SCALE
    if (acts.kind, acts.bits, acts.strategy, acts.dynamic) == ("float", 4, "tensor_group", "local"):
        return NVFP4_INPUT_GLOBAL_SCALE
    return None


def fp8_input_scale(absmax: torch.Tensor) -> torch.Tensor:
    """absmax / 448 as float32 [1]; zero (a linear that saw only zeros) becomes float32's eps."""
    return fp8.scale_of_absmax(absmax.to(torch.float32).reshape(1))  # the weights' rule, one place


def nvfp4_input_global_scale(absmax: torch.Tensor) -> torch.Tensor:
    """448 * 6 / absmax as float32 [1] (`nvfp4.global_scale`, the same rule as the weight's)."""
    return nvfp4.global_scale(absmax.to(torch.float32).reshape(1))


def input_scale_for(acts: QuantArgs, absmax: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """(tensor name, value) a linear quantized with activations `acts` stores, None when it stores none."""
    name = tensor_name(acts)
    if name is None:
        return None
    return name, (fp8_input_scale(absmax) if name == FP8_INPUT_SCALE else nvfp4_input_global_scale(absmax))
