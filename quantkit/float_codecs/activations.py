"""Input-activation quantization of the float presets, as a runtime applies it before the matmul (fake-quantized:
quantize, then dequantize, in float32).

The rules are compressed-tensors 0.20.1's (`lifecycle.forward.forward_quantize` with
`compute_dynamic_scales_and_zp`), which vLLM's kernels follow:
    FP8 token (FP8_DYNAMIC)        per row of the flattened input: scale absmax/448, E4M3 codes
    FP8 group (FP8_BLOCK's 1x128)  per run of `group_size` input features, the same rule
    FP8 group 32, E8M0 (MXFP8)     MXFP8 of the input: E4M3 under each group's power-of-two scale
    FP8 tensor, dynamic            one scale for the whole input; static (FP8): the checkpoint's input_scale
    FP4 group 32, E8M0 (MXFP4)     MXFP4 of the input, groups along the features
    FP4 tensor_group 16 (NVFP4)    NVFP4 of the input under the checkpoint's input_global_scale
Each reuses the weight codec of the same grid (`fp8`, `mxfp4`, `nvfp4`), so activations and weights round alike.
"""
from __future__ import annotations

from typing import Optional

import torch

from quantkit.errors import QuantkitError
from quantkit.float_codecs import e4m3, fp8, mxfp4, mxfp8, nvfp4
from quantkit.scheme_presets import QuantArgs


def check_supported(args: QuantArgs) -> Optional[str]:
    """The tensor this scheme needs from the checkpoint ("input_scale", "input_global_scale" or None), or
    QuantkitError naming the activation scheme no rule above covers."""
    key = (args.kind, args.bits, args.strategy, args.dynamic)
    if key == ("float", 8, "group", True) and args.scale_dtype is not None:  # an MX format: E8M0 scales only
        if (args.group_size, args.scale_dtype) == (mxfp8.GROUP_SIZE, "uint8"):
            return None
        raise QuantkitError(f"FP8 input activations in groups of {args.group_size} with {args.scale_dtype} scales are "
                            f"not run by quantkit's loader; it runs MXFP8 (groups of {mxfp8.GROUP_SIZE}, uint8 E8M0 "
                            "scales) and float32-scaled FP8 groups")
    if key in (("float", 8, "token", True), ("float", 8, "group", True), ("float", 8, "tensor", True)):
        return None
    if key == ("float", 8, "tensor", False):
        return "input_scale"
    if key == ("float", 4, "group", True) and (args.group_size, args.scale_dtype) == (mxfp4.GROUP_SIZE, "uint8"):
        return None
    if key == ("float", 4, "tensor_group", "local") and args.group_size == nvfp4.GROUP_SIZE:
        return "input_global_scale"
    raise QuantkitError(f"input activations quantized as {args.kind} {args.bits}-bit {args.strategy} "
                        f"(dynamic={args.dynamic}) are not run by quantkit's loader; it runs FP8 token/group/tensor, "
                        "MXFP8, MXFP4 and NVFP4 activations")


def fake_quantize(x: torch.Tensor, args: QuantArgs, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`x` [..., K] rounded onto the activation grid `args` and back (float32 math, returned in x's dtype);
    `scale` is the checkpoint's input_scale (static FP8) or input_global_scale (NVFP4)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).to(torch.float32)
    if args.bits == 8 and args.strategy == "tensor":
        s = scale.to(torch.float32).reshape(1) if scale is not None else fp8.quantize(rows, "tensor").scale
        out = e4m3.to_e4m3(rows / s).to(torch.float32) * s
    elif args.bits == 8 and args.strategy == "token":
        out = fp8.quantize(rows, "channel").dequantize()
    elif args.bits == 8 and args.strategy == "group" and args.scale_dtype == "uint8":
        out = mxfp8.quantize(rows).dequantize()
    elif args.bits == 8 and args.strategy == "group":
        g = args.group_size
        if k % g:
            raise QuantkitError(f"FP8 group activations need an input size that is a multiple of {g}, got {k}")
        out = fp8.quantize(rows.reshape(-1, g), "channel").dequantize().reshape(rows.shape)
    elif args.strategy == "group":
        out = mxfp4.fake_quantize(rows)
    else:
        out = nvfp4.fake_quantize(rows, scale if scale is not None else nvfp4.global_scale(rows))
    return out.reshape(x.shape).to(x.dtype)


def rounds_without_scales(args: QuantArgs) -> bool:
    """Whether `fake_quantize_split_free` can round inputs under `args`: every rule above but static FP8's one
    per-tensor scale (a number only the whole calibration set fixes, which it could not stand in for)."""
    return (args.bits, args.strategy, args.dynamic) != (8, "tensor", False)


def fake_quantize_split_free(x: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """`fake_quantize` of calibration inputs without a calibrated scale, so the result of a row does not depend
    on the rows beside it (how the samples are batched, chunked or split among data-parallel ranks): the dynamic
    rules as they are; NVFP4 with each row's own global scale in place of the static input_global_scale (the
    group scales are E4M3 either way, whose relative step is the same over its normal range)."""
    if not rounds_without_scales(args):
        raise QuantkitError("static per-tensor FP8 input scales are fixed by the whole calibration set; "
                            "its inputs cannot be rounded row by row")
    if args.kind == "float" and args.bits == 4 and args.strategy == "tensor_group":
        rows = x.reshape(-1, x.shape[-1])
        return nvfp4.fake_quantize(rows, nvfp4.row_global_scales(rows)).reshape(x.shape).to(x.dtype)
    return fake_quantize(x, args)
