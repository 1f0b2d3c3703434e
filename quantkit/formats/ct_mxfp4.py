"""compressed-tensors "mxfp4-pack-quantized" (the MXFP4A16 and MXFP4 presets).

Checked against compressed-tensors 0.20.1 (`compressors/mxfp4`, MXFP4PackedCompressor):
    weight_packed  uint8 [N, K/2]   two E2M1 codes per byte (`fp4_nibbles`)
    weight_scale   uint8 [N, K/32]  E8M0 exponent, scale 2**(code - 127)
No global scale.
"""
from __future__ import annotations

import torch

from quantkit.errors import QuantkitError
from quantkit.float_codecs.mxfp4 import GROUP_SIZE, Mxfp4Weight
from quantkit.formats import fp4_nibbles
from quantkit.formats.ct_tensor_checks import take
from quantkit.scheme_presets import QuantArgs

FORMAT = "mxfp4-pack-quantized"


def can_store(weights: QuantArgs) -> tuple[bool, str]:
    """Whether this layout stores weights quantized as `weights`, and if not, why (one line)."""
    wanted = ("float", 4, "group", GROUP_SIZE, "uint8")
    got = (weights.kind, weights.bits, weights.strategy, weights.group_size, weights.scale_dtype)
    if got != wanted:
        return False, (f"{FORMAT} stores FP4 (E2M1) weights in groups of {GROUP_SIZE} with E8M0 scales, not "
                       f"{weights.kind} {weights.bits}-bit {weights.strategy} group {weights.group_size} "
                       f"scale {weights.scale_dtype}")
    return True, ""


def packed_shapes(shape: tuple[int, int], weights: QuantArgs | None = None
                  ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{tensor suffix: (shape, dtype)} one [N, K] linear stores (what a loader allocates and checks)."""
    n, k = shape
    if k % GROUP_SIZE:
        raise QuantkitError(f"{FORMAT} needs an input size that is a multiple of {GROUP_SIZE}, got {k}")
    return {"weight_packed": ((n, k // 2), torch.uint8), "weight_scale": ((n, k // GROUP_SIZE), torch.uint8)}


def read(tensors: dict[str, torch.Tensor], shape: tuple[int, int], weights: QuantArgs) -> Mxfp4Weight:
    """One [N, K] linear's weight from its tensors (checked); `weights` is fixed by the layout."""
    return unpack(tensors, shape)


def pack(w: Mxfp4Weight) -> dict[str, torch.Tensor]:
    return {"weight_packed": fp4_nibbles.pack(w.codes), "weight_scale": w.scale_codes.contiguous()}


def unpack(tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> Mxfp4Weight:
    got = {name: take(tensors, name, dtype, want, FORMAT) for name, (want, dtype) in packed_shapes(shape).items()}
    return Mxfp4Weight(fp4_nibbles.unpack(got["weight_packed"]), got["weight_scale"])
