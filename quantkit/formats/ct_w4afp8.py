"""compressed-tensors "pack-quantized" integer weights under FP8 activations (the W4AFP8 preset), in the layout
interface the float loader and writer use (`can_store`, `packed_shapes`, `read`, `pack`).

The tensors are exactly pack-quantized's (`quantkit.formats.compressed_tensors`, which packs and unpacks them:
one packer per format): weight_packed int32 [N, K*b/32], weight_scale [N, K/group], weight_shape int64 [2],
symmetric only. What differs from W4A16 is the config group's input_activations (float 8-bit, strategy token,
dynamic), which a runtime applies per row of the input (`float_codecs.activations`); vLLM reads it as
CompressedTensorsW4A8Fp8 (Hopper only).
"""
from __future__ import annotations

import torch

from quantkit.formats import compressed_tensors
from quantkit.formats.spec import LinearSpec
from quantkit.qtensor import QuantizedWeight
from quantkit.scheme_presets import QuantArgs

FORMAT = compressed_tensors.FORMAT


def can_store(weights: QuantArgs, layout: str = FORMAT) -> tuple[bool, str]:
    """Whether `layout` (this one, or llm-compressor's int-quantized W4AFP8, `ct_int_w4afp8`: both hold the
    same weights) stores weights quantized as `weights`, and if not, why (one line)."""
    if weights.kind != "int" or not 2 <= weights.bits <= 8:
        return False, f"{layout} stores 2..8-bit integer weights, not {weights.kind} {weights.bits}-bit"
    if weights.strategy not in ("group", "channel") or not weights.symmetric:
        return False, (f"{layout} under FP8 activations stores symmetric integer weights per group or channel, "
                       f"not {'symmetric' if weights.symmetric else 'asymmetric'} per {weights.strategy}")
    return True, ""


def spec_of(shape: tuple[int, int], weights: QuantArgs) -> LinearSpec:
    n, k = shape
    return LinearSpec(out_features=n, in_features=k, bits=weights.bits,
                      group_size=weights.group_size if weights.strategy == "group" else -1, sym=True)


def packed_shapes(shape: tuple[int, int], weights: QuantArgs) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{tensor suffix: (shape, dtype)} one [N, K] linear stores (compressed_tensors' own, checked there)."""
    return compressed_tensors.packed_shapes(spec_of(shape, weights))


def read(tensors: dict[str, torch.Tensor], shape: tuple[int, int], weights: QuantArgs) -> QuantizedWeight:
    """One [N, K] linear's weight from its tensors (checked), under the config's weights args."""
    return compressed_tensors.unpack(tensors, spec_of(shape, weights))


def pack(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    return compressed_tensors.pack(qw)
