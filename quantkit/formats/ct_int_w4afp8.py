"""compressed-tensors "int-quantized" integer weights under FP8 activations: what llm-compressor 0.14 (with
compressed-tensors 0.19 / 0.20) writes for the W4AFP8 preset, read by `quantkit.load` (quantkit itself writes
W4AFP8 pack-quantized, `ct_w4afp8`, the layout vLLM's CompressedTensorsW4A8Fp8 loads).

compressed-tensors picks int-quantized for any integer weight that has input activations
(`IntQuantizationCompressor`, ahead of pack-quantized, which declines float activations); its tensors:
    weight        int8  [N, K]   the signed integer codes, unpacked (-8..7 for 4-bit)
    weight_scale  float [N, G]   G = K / group_size, 1 per channel; the model's dtype (float32 or bfloat16)
symmetric only (no zero point), dequantized as weight * scale, each scale repeated over its group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.formats import ct_w4afp8
from quantkit.formats.ct_tensor_checks import take
from quantkit.scheme_presets import QuantArgs

FORMAT = "int-quantized"


@dataclass(frozen=True)
class IntWeight:
    codes: torch.Tensor  # int8 [N, K], signed
    scale: torch.Tensor  # float32 [N, G]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        group = self.codes.shape[1] // self.scale.shape[1]
        return (self.codes.to(torch.float32) * self.scale.repeat_interleave(group, dim=1)).to(dtype)


def can_store(weights: QuantArgs) -> tuple[bool, str]:
    """Whether this layout holds weights quantized as `weights`, and if not, why (one line): the same weights
    as quantkit's own pack-quantized W4AFP8, so its declaration serves both."""
    return ct_w4afp8.can_store(weights, FORMAT)


def packed_shapes(shape: tuple[int, int], weights: QuantArgs) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{tensor suffix: (shape, dtype)} one [N, K] linear stores (scales held as float32: the loader widens
    bfloat16 / float16 ones losslessly)."""
    n, k = shape
    if weights.strategy == "group" and k % weights.group_size:
        raise QuantkitError(f"{FORMAT}: group_size {weights.group_size} must divide in_features {k}")
    groups = k // weights.group_size if weights.strategy == "group" else 1
    return {"weight": ((n, k), torch.int8), "weight_scale": ((n, groups), torch.float32)}


def read(tensors: dict[str, torch.Tensor], shape: tuple[int, int], weights: QuantArgs) -> IntWeight:
    """One [N, K] linear's weight from its tensors (checked: dtype, shape, codes inside the signed range)."""
    shapes = packed_shapes(shape, weights)
    codes = take(tensors, "weight", torch.int8, shapes["weight"][0], FORMAT)
    scale = take(tensors, "weight_scale", torch.float32, shapes["weight_scale"][0], FORMAT)
    low, high = -(1 << (weights.bits - 1)), (1 << (weights.bits - 1)) - 1
    if codes.numel() and (int(codes.min()) < low or int(codes.max()) > high):
        raise QuantkitError(f"{FORMAT}: tensor 'weight' holds codes outside {weights.bits}-bit [{low}, {high}]; "
                            "the checkpoint is damaged or its config is not the one it was written with")
    return IntWeight(codes, scale)
