"""Which of vLLM's fused-MoE kernels can serve a checkpoint's experts, read from vLLM's code (not run).

vLLM stacks the per-expert tensors (``experts.{e}.gate_proj/up_proj/down_proj.<suffix>``) into one
fused MoE layer, and one kernel must take all of them (`vllm/model_executor/layers/quantization/`):
- Marlin MoE (`utils/marlin_utils.check_moe_marlin_supports_layer`): 4 or 8 bits, group size
  -1/32/64/128, hidden % 128 == 0, expert width (per tensor-parallel rank) % max(64, group) == 0;
  gptq only symmetric (`gptq_marlin`; act-order fine), awq 4-bit with zero points, compressed-tensors
  pack-quantized (`compressed_tensors_moe`).
- otherwise `moe_wna16` (Triton): gptq with desc_act off (8-bit only per channel), awq 4-bit,
  compressed-tensors pack-quantized 4/8-bit.
- W8A8 (compressed-tensors int-quantized, `CompressedTensorsW8A8Int8MoEMethod`): int8 per-channel
  weights with dynamic per-token activations only (static input scales are refused).
Nothing takes 2- or 3-bit experts. quantkit.load runs every scheme; this only says what vLLM will.
"""
from __future__ import annotations

from typing import Optional

from quantkit.formats.spec import LinearSpec

MARLIN, WNA16, W8A8_INT8 = "marlin", "moe_wna16", "w8a8_int8"


def moe_kernel(fmt: str, spec: LinearSpec, hidden: int, intermediate: int, tp: int = 1) -> tuple[Optional[str], str]:
    """(kernel, why): the vLLM MoE kernel for experts stored as `spec` in format `fmt`, or (None, reason)."""
    if spec.input_quant is not None:
        if spec.input_quant == "token":
            return W8A8_INT8, "int8 per-channel weights, dynamic per-token int8 activations"
        return None, "vLLM's int8 MoE method takes dynamic per-token activations only, not static input scales"
    if spec.bits not in (4, 8):
        return None, f"vLLM's MoE kernels take 4- and 8-bit experts, not {spec.bits}-bit"
    g = spec.group_size
    shape_ok = hidden % 128 == 0 and (intermediate // tp) % max(64, g) == 0 and g in (-1, 32, 64, 128)
    if fmt == "awq":
        return (MARLIN if shape_ok else WNA16), "awq 4-bit with zero points"
    if fmt == "gptq" and shape_ok and spec.sym:
        return MARLIN, "gptq symmetric"
    if fmt == "compressed-tensors" and shape_ok:
        return MARLIN, "compressed-tensors pack-quantized"
    if fmt == "gptq" and spec.act_order != "none":
        return None, ("vLLM's Marlin MoE kernel needs symmetric weights, hidden % 128 == 0 and an expert width "
                      "divisible by max(64, group); its fallback (moe_wna16) needs desc_act off")
    if fmt == "gptq" and spec.bits == 8 and g != -1:
        return None, "vLLM's fallback MoE kernel (moe_wna16) takes 8-bit gptq experts per channel only (group -1)"
    return WNA16, "the shape or scheme is outside Marlin MoE"
