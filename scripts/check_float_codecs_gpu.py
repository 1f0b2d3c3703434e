"""GPU check of quantkit's float grids (#47): run on a CUDA machine with compressed-tensors installed.

1. quantkit's codecs on CUDA give bit-identical results to the same codecs on CPU (they are device-agnostic).
2. compressed-tensors' GPU paths (Triton kernels: the fused FP4 quantize+pack, the quantize kernel with its
   float8e4nv cast on SM90+) agree byte for byte with quantkit's codes / FP8 values, and compressed-tensors'
   decompressors on CUDA give quantkit's dequantized weights.
Prints one line per check with mismatch counts; exits 1 if any check disagrees.
    python scripts/check_float_codecs_gpu.py
"""
from __future__ import annotations

import sys

import torch

from quantkit.float_codecs import e2m1, e8m0, fp8, mxfp4, nvfp4
from quantkit.formats import ct_float_quantized, ct_mxfp4, ct_nvfp4, fp4_nibbles


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.dtype in (torch.float8_e4m3fn,):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape:
        return -1
    if a.is_floating_point():
        return int(((a != b) & ~(torch.isnan(a) & torch.isnan(b))).sum())
    return int((a != b).sum())


def main() -> int:
    from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor
    from compressed_tensors.compressors.naive_quantized import FloatQuantizationCompressor
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    assert torch.cuda.is_available(), "needs a CUDA GPU"
    print("device:", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
    failures = 0

    def report(what: str, n: int) -> None:
        nonlocal failures
        failures += n != 0
        print(f"{'ok  ' if n == 0 else 'FAIL'} {what}: {n} mismatches")

    g = torch.Generator().manual_seed(0)
    w_cpu = torch.randn(2048, 4096, generator=g) * 0.02
    w_cpu[7, 100] = 0.9
    w_cpu[9, :64] = 0.0
    w = w_cpu.cuda()

    # 1. device-agnostic codecs
    q_nv, q_nv_cpu = nvfp4.quantize(w), nvfp4.quantize(w_cpu)
    report("nvfp4 codes cuda vs cpu", mismatches(q_nv.codes, q_nv_cpu.codes))
    report("nvfp4 scales cuda vs cpu", mismatches(q_nv.group_scale, q_nv_cpu.group_scale))
    q_mx, q_mx_cpu = mxfp4.quantize(w), mxfp4.quantize(w_cpu)
    report("mxfp4 codes cuda vs cpu", mismatches(q_mx.codes, q_mx_cpu.codes))
    report("mxfp4 scales cuda vs cpu", mismatches(q_mx.scale_codes, q_mx_cpu.scale_codes))
    fp8_cases = {"FP8_DYNAMIC": ("channel", None), "FP8_BLOCK": ("block", (128, 128)), "FP8": ("tensor", None)}
    for name, (strategy, block) in fp8_cases.items():
        a, b = fp8.quantize(w, strategy, block), fp8.quantize(w_cpu, strategy, block)
        report(f"fp8 {strategy} values cuda vs cpu", mismatches(a.values, b.values) + mismatches(a.scale, b.scale))
    x = torch.randn(1 << 20, generator=g).mul(3).cuda()
    report("e2m1 encode cuda vs cpu", mismatches(e2m1.encode(x), e2m1.encode(x.cpu())))

    # 2. compressed-tensors' GPU kernels as the oracle
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    ct = NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": q_nv.group_scale.float(), "weight_global_scale": q_nv.global_scale}, scheme)
    report("nvfp4 packed bytes (compressed-tensors triton)",
           mismatches(ct["weight_packed"], fp4_nibbles.pack(q_nv.codes)))
    back = NVFP4PackedCompressor.decompress(dict(ct_nvfp4.pack(q_nv)), scheme)["weight"]
    report("nvfp4 decompressed weight", mismatches(back, q_nv.dequantize(torch.bfloat16)))

    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    ct = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": e8m0.decode(q_mx.scale_codes)}, scheme)
    report("mxfp4 packed bytes (compressed-tensors triton)",
           mismatches(ct["weight_packed"], fp4_nibbles.pack(q_mx.codes)))
    report("mxfp4 scale bytes", mismatches(ct["weight_scale"], q_mx.scale_codes))
    back = MXFP4PackedCompressor.decompress(dict(ct_mxfp4.pack(q_mx)), scheme)["weight"]
    report("mxfp4 decompressed weight", mismatches(back, q_mx.dequantize(torch.bfloat16)))

    for name, (strategy, block) in fp8_cases.items():
        q = fp8.quantize(w, strategy, block)
        scheme = preset_name_to_scheme(name, ["Linear"])
        ct = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": q.scale}, scheme)
        report(f"fp8 {strategy} values (compressed-tensors)", mismatches(ct["weight"], q.values))
        back = FloatQuantizationCompressor.decompress(dict(ct_float_quantized.pack(q)), scheme)["weight"]
        report(f"fp8 {strategy} decompressed weight", mismatches(back, q.dequantize()))
    # compressed-tensors' scale rules evaluated on CUDA against quantkit's scales on CUDA
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]).weights
    ct_scale, _ = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args)
    report("fp8 channel scales vs calculate_qparams on cuda", mismatches(ct_scale, fp8.quantize(w, "channel").scale))
    args = preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    gs = generate_gparam(w.amin(), w.amax())
    groups = w.reshape(w.shape[0], -1, 16)
    ct_scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=gs)
    report("nvfp4 global + group scales vs compressed-tensors on cuda",
           mismatches(gs, q_nv.global_scale) + mismatches(ct_scale, q_nv.group_scale.float()))
    args = preset_name_to_scheme("MXFP4A16", ["Linear"]).weights
    groups = w.reshape(w.shape[0], -1, 32)
    ct_scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    report("mxfp4 scales vs calculate_qparams on cuda", mismatches(ct_scale, e8m0.decode(q_mx.scale_codes)))
    print("all agree" if failures == 0 else f"{failures} checks disagree")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
