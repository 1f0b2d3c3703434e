"""compressed-tensors "float-quantized" (FP8 weights: the FP8, FP8_DYNAMIC and FP8_BLOCK presets).

Checked against compressed-tensors 0.20.1 (`compressors/naive_quantized`, FloatQuantizationCompressor):
    weight        float8_e4m3fn [N, K]
    weight_scale  float32       [1] (tensor) | [N, 1] (channel) | [ceil(N/r), ceil(K/c)] (block r x c)
dequantized as weight * scale, the scale repeated over its tensor / row / block.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from quantkit.errors import QuantkitError
from quantkit.float_codecs.fp8 import Fp8Weight
from quantkit.formats.ct_tensor_checks import take
from quantkit.scheme_presets import QuantArgs

FORMAT = "float-quantized"


def can_store(weights: QuantArgs) -> tuple[bool, str]:
    """Whether this layout stores weights quantized as `weights`, and if not, why (one line)."""
    if (weights.kind, weights.bits) != ("float", 8):
        return False, f"{FORMAT} stores FP8 (E4M3) weights, not {weights.kind} {weights.bits}-bit"
    if weights.strategy not in ("tensor", "channel", "block"):
        return False, f"{FORMAT} stores FP8 scales per tensor, channel or block, not per {weights.strategy}"
    return True, ""


def scale_shape(shape: tuple[int, int], strategy: str, block_size: Optional[tuple[int, int]]) -> tuple[int, ...]:
    n, k = shape
    if strategy == "tensor":
        return (1,)
    if strategy == "channel":
        return (n, 1)
    if strategy == "block":
        return (math.ceil(n / block_size[0]), math.ceil(k / block_size[1]))
    raise QuantkitError(f"{FORMAT} stores FP8 weights per tensor, channel or block, not {strategy!r}")


def packed_shapes(shape: tuple[int, int], weights: QuantArgs) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{tensor suffix: (shape, dtype)} one [N, K] linear stores (what a loader allocates and checks)."""
    return {"weight": (tuple(shape), torch.float8_e4m3fn),
            "weight_scale": (scale_shape(shape, weights.strategy, weights.block_size), torch.float32)}


def read(tensors: dict[str, torch.Tensor], shape: tuple[int, int], weights: QuantArgs) -> Fp8Weight:
    """One [N, K] linear's weight from its tensors (checked), under the config's weights args."""
    return unpack(tensors, shape, weights.strategy, weights.block_size)


def pack(w: Fp8Weight) -> dict[str, torch.Tensor]:
    return {"weight": w.values.contiguous(), "weight_scale": w.scale.to(torch.float32).contiguous()}


def unpack(tensors: dict[str, torch.Tensor], shape: tuple[int, int], strategy: str,
           block_size: Optional[tuple[int, int]] = None) -> Fp8Weight:
    expected_scale = scale_shape(shape, strategy, block_size)
    values = take(tensors, "weight", torch.float8_e4m3fn, shape, FORMAT)
    scale = take(tensors, "weight_scale", torch.float32, expected_scale, FORMAT)
    return Fp8Weight(values, scale, strategy, tuple(block_size) if block_size else None)
