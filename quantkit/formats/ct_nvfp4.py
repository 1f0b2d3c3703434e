"""compressed-tensors "nvfp4-pack-quantized" (the NVFP4A16 and NVFP4 presets).

Checked against compressed-tensors 0.20.1 (`compressors/nvfp4`, NVFP4PackedCompressor):
    weight_packed        uint8         [N, K/2]   two E2M1 codes per byte (`fp4_nibbles`)
    weight_scale         float8_e4m3fn [N, K/16]
    weight_global_scale  float32       [1]        dequantized as e2m1 * weight_scale / weight_global_scale
"""
from __future__ import annotations

import torch

from quantkit.errors import QuantkitError
from quantkit.float_codecs.nvfp4 import GROUP_SIZE, Nvfp4Weight
from quantkit.formats import fp4_nibbles
from quantkit.formats.ct_tensor_checks import take
from quantkit.scheme_presets import QuantArgs

FORMAT = "nvfp4-pack-quantized"


def can_store(weights: QuantArgs) -> tuple[bool, str]:
    """Whether this layout stores weights quantized as `weights`, and if not, why (one line)."""
    wanted = ("float", 4, "tensor_group", GROUP_SIZE, "float8_e4m3fn")
    got = (weights.kind, weights.bits, weights.strategy, weights.group_size, weights.scale_dtype)
    if got != wanted:
        return False, (f"{FORMAT} stores FP4 (E2M1) weights in groups of {GROUP_SIZE} with E4M3 scales under a "
                       f"global scale, not {weights.kind} {weights.bits}-bit {weights.strategy} "
                       f"group {weights.group_size} scale {weights.scale_dtype}")
    return True, ""


def packed_shapes(shape: tuple[int, int], weights: QuantArgs) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{tensor suffix: (shape, dtype)} one [N, K] linear stores (what a loader allocates and checks)."""
    n, k = shape
    if k % GROUP_SIZE:
        raise QuantkitError(f"{FORMAT} needs an input size that is a multiple of {GROUP_SIZE}, got {k}")
    return {"weight_packed": ((n, k // 2), torch.uint8), "weight_scale": ((n, k // GROUP_SIZE), torch.float8_e4m3fn),
            "weight_global_scale": ((1,), torch.float32)}


def read(tensors: dict[str, torch.Tensor], shape: tuple[int, int], weights: QuantArgs) -> Nvfp4Weight:
    """One [N, K] linear's weight from its tensors (checked); `weights` is fixed by the layout."""
    return unpack(tensors, shape)


def pack(w: Nvfp4Weight) -> dict[str, torch.Tensor]:
    return {"weight_packed": fp4_nibbles.pack(w.codes), "weight_scale": w.group_scale.contiguous(),
            "weight_global_scale": w.global_scale.to(torch.float32).reshape(1)}


def unpack(tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> Nvfp4Weight:
    n, k = shape
    if k % GROUP_SIZE:
        raise QuantkitError(f"{FORMAT} needs an input size that is a multiple of {GROUP_SIZE}, got {k}")
    packed = take(tensors, "weight_packed", torch.uint8, (n, k // 2), FORMAT)
    scale = take(tensors, "weight_scale", torch.float8_e4m3fn, (n, k // GROUP_SIZE), FORMAT)
    global_scale = take(tensors, "weight_global_scale", torch.float32, (1,), FORMAT)
    return Nvfp4Weight(fp4_nibbles.unpack(packed), scale, global_scale)
