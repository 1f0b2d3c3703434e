"""Matmul backends for `QuantLinear`: each turns the format's packed tensors into y = x @ W^T.

A backend is built once per module (``prepare``), after the state dict is loaded, and reads the
checkpoint only through ``format.unpack``; it never adds bias (QuantLinear does).
- reference: dequantize on every call and F.linear; any device; the oracle the others are tested against.
- cpu: PyTorch's packed CPU kernels. Only their bf16 paths are vectorised (measured on a 4096x4096
  matvec: int4 1.2 ms in bf16 vs 24 ms fp16 and 61 ms fp32; int8 1.2 ms bf16 vs 30/43 ms), so
  activations are cast to bf16 and the result back to the input dtype. The kernels are private
  aten ops, probed once against the reference (`cpu_kernel_problem`); a missing or disagreeing op,
  or a shape the kernel cannot take, falls back to a cached dequantized weight, one notice per reason.
  At decode sizes (up to DECODE_ROWS rows) 4-bit and per-channel 8-bit layers take quantkit's own
  AVX2 kernels instead (kernels.cpu_gemv: int8 activations, llama.cpp's arithmetic), where they compile.
- W8A8 weights (int8 activations too) go to `runtime.w8a8`'s backends of the same names.
- triton: quantkit.kernels' dequant-GEMM (split-K for decode, tiled tl.dot for prefill) on a
  one-time repack to the gptq layout; falls back to a cached dequantized weight where Triton cannot
  run (no CUDA device); refused outright when the triton package is not installed.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError, first_line
from quantkit.notices import notice
from quantkit.qtensor import QuantizedWeight

BACKENDS = ("auto", "reference", "cpu", "triton")
INT4_GROUP_SIZES = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu accepts
# PyTorch's private packed CPU ops by weight bits: renamed and re-laid-out between releases, so
# each is feature-detected once (`cpu_kernel_problem`) before a layer relies on it
CPU_KERNEL_OPS = {4: ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu"),
                  8: ("_weight_int8pack_mm",)}


def resolve(name: str, device: torch.device) -> str:
    """The backend `name` means on `device`: "auto" is cpu on the CPU, triton on CUDA where triton
    is installed, else reference. "triton" without the triton package is refused here, at once."""
    if name not in BACKENDS:
        raise QuantkitError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        if device.type == "cpu":
            return "cpu"
        if device.type == "cuda" and _triton_installed():
            return "triton"
        notice(f"quantkit: no packed kernel for {device.type} here"
               f"{' (triton is not installed)' if device.type == 'cuda' else ''}; backend auto uses reference")
        return "reference"
    if name == "triton" and not _triton_installed():
        raise QuantkitError("the triton backend needs the triton package, which is not installed (it has Linux "
                            "wheels only); use --backend auto, cpu or reference")
    return name


def _triton_installed() -> bool:
    from quantkit.kernels import triton_support

    return triton_support.triton_installed()


def _flat(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.shape[-1] != k:
        raise QuantkitError(f"input has {x.shape[-1]} features, the layer expects {k}")
    return x.reshape(-1, k)


class ReferenceBackend:
    name = "reference"

    def __init__(self, qw: QuantizedWeight, device: torch.device):
        self.qw = QuantizedWeight(qweight=qw.qweight.to(device), scales=qw.scales.to(device),
                                  zeros=qw.zeros.to(device), g_idx=qw.g_idx.to(device), bits=qw.bits,
                                  group_size=qw.group_size, sym=qw.sym, act_order=qw.act_order)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.qw.dequantize(x.dtype))


class DequantizedBackend:
    """Fallback: dequantize once per activation dtype, then a dense matmul."""
    name = "dequantized"

    def __init__(self, qw: QuantizedWeight, device: torch.device):
        self.qw, self.device, self.cache = qw, device, {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.cache.get(x.dtype)
        if w is None:
            w = self.cache[x.dtype] = self.qw.dequantize(x.dtype).to(self.device)
        return F.linear(x, w)


def _contiguous_groups(qw: QuantizedWeight) -> tuple[torch.Tensor | None, torch.Tensor, int]:
    """Input permutation that makes every group a contiguous run of equal length, or raise ValueError.

    Returns (perm or None when the identity, codes with columns permuted, group length)."""
    n, k = qw.qweight.shape
    gs = k if qw.group_size == -1 else qw.group_size
    g = qw.g_idx.long().cpu()
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], torch.arange(k) // gs) or k % gs:
        raise ValueError("groups are not equal contiguous runs after sorting g_idx")
    if torch.equal(perm, torch.arange(k)):
        return None, qw.qweight, gs
    return perm, qw.qweight[:, perm], gs


DECODE_ROWS = 16  # up to this many rows 4- and 8-bit layers take kernels.cpu_gemv's kernels (decode, verification)
ENV_DECODE_KERNEL = "QUANTKIT_CPU_DECODE_KERNEL"  # "0": PyTorch's kernels at every size (A/B runs)


@functools.lru_cache(maxsize=None)
def cpu_decode_kernel():
    """kernels.cpu_gemv's compiled int4/int8/fp32 kernels, built once per machine into the quantkit cache; None
    when switched off (``QUANTKIT_CPU_DECODE_KERNEL=0``) or, with one notice saying why, when there is
    no compiler, no AVX2, or their output disagrees with their PyTorch references on a probe."""
    import os

    from quantkit.assets import cache_dir
    from quantkit.kernels import cpu_gemv

    if os.environ.get(ENV_DECODE_KERNEL, "1") == "0":
        return None
    kernel = cpu_gemv.CpuGemvKernels(cache_dir() / "cpu-kernels")
    problem = kernel.problem
    for bits in (4, 8, 32) if problem is None else ():
        if bits == 32:  # fp32 weights: the exact product (fp64 reference), no activation quantization
            gen = torch.Generator().manual_seed(0)
            w, b, x = torch.randn(37, 100, generator=gen), torch.randn(37, generator=gen), torch.randn(5, 100, generator=gen)
            got = kernel.prepare_f32(w, b)(x)
            want = F.linear(x.double(), w.double(), b.double()).float()
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())):
                problem = "its fp32 output disagrees with F.linear on a probe"
            continue
        qw, x = _probe_case(bits)
        if bits == 4:
            got = kernel.prepare_int4(qw.qweight, qw.scales, qw.zeros, qw.group_size)(x.float())
            want = cpu_gemv.reference_int4_gemv(x.float(), qw.qweight, qw.scales, qw.zeros, qw.group_size)
        else:
            got = kernel.prepare_int8(qw.signed_int8(), qw.scales)(x.float())
            want = cpu_gemv.reference_int8_gemv(x.float(), qw.signed_int8(), qw.scales)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
            problem = f"its {bits}-bit output disagrees with its PyTorch reference on a probe"
    if problem is not None:
        notice(f"quantkit cpu backend: the decode kernels are off ({problem}); PyTorch's kernels serve every size")
        return None
    return kernel


def _int4_decode_plan(qw: QuantizedWeight, codes: torch.Tensor, gs: int, device: torch.device):
    """The int8-activation kernel for up to DECODE_ROWS rows, or None where it does not apply."""
    kernel = cpu_decode_kernel()
    if kernel is None or device.type != "cpu" or gs % 32 or codes.shape[1] % gs:
        return None
    return kernel.prepare_int4(codes, qw.scales, qw.zeros, gs)


def _int4_plan(qw: QuantizedWeight, device: torch.device, decode_kernel: bool = True) -> tuple[Callable, Optional[object]]:
    """PyTorch's packed int4 kernel (activations rounded to bf16), and for a few rows, where it builds
    and the groups allow, kernels.cpu_gemv's (activations quantized to int8 per 32, llama.cpp's
    arithmetic; 2.7-6.0x faster at one row on the demo's shapes, scripts/bench_cpu_gemv.py). Output: bf16
    from the first, fp32 from the second. Returns (matmul, the decode kernel where it takes the input
    columns as they come, i.e. no act-order permutation, else None)."""
    n, k = qw.qweight.shape
    if n % 16:
        raise ValueError(f"int4 kernel needs out_features divisible by 16 (got {n})")
    perm, codes, gs = _contiguous_groups(qw)
    kernel_gs = next((c for c in INT4_GROUP_SIZES if gs % c == 0), None)
    if kernel_gs is None:
        raise ValueError(f"int4 kernel takes group sizes 32/64/128/256 (or multiples), not {gs}")
    repeat = gs // kernel_gs  # a larger group (or per-channel) is the same scale repeated
    scales = qw.scales.float().repeat_interleave(repeat, dim=1)
    zeros = qw.zeros.float().repeat_interleave(repeat, dim=1)
    # tinygemm: w = (q - 8) * scale + zero_f, so zero_f = (8 - z) * scale
    scales_and_zeros = torch.stack([scales.t(), ((8 - zeros) * scales).t()], dim=-1)
    scales_and_zeros = scales_and_zeros.to(torch.bfloat16).contiguous().to(device)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).to(device), 2)
    perm = None if perm is None else perm.to(device)
    decode = _int4_decode_plan(qw, codes, gs, device) if decode_kernel else None

    def run(x2: torch.Tensor) -> torch.Tensor:
        if perm is not None:
            x2 = x2[:, perm]
        if decode is not None and x2.shape[0] <= DECODE_ROWS:
            return decode(x2)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), packed,
                                                          kernel_gs, scales_and_zeros)
    return run, decode if perm is None else None


def _int8_plan(qw: QuantizedWeight, device: torch.device, decode_kernel: bool = True) -> tuple[Callable, Optional[object]]:
    """PyTorch's int8 kernel (bf16), and up to DECODE_ROWS rows kernels.cpu_gemv's where it builds.
    Returns (matmul, the decode kernel or None)."""
    if qw.n_groups != 1:
        raise ValueError("int8 kernel needs per-channel scales (group_size -1)")
    w_int8 = qw.signed_int8().to(device)
    scales = qw.scales[:, 0].to(torch.bfloat16).contiguous().to(device)
    kernel = cpu_decode_kernel() if decode_kernel and device.type == "cpu" else None
    decode = kernel.prepare_int8(w_int8, qw.scales) if kernel is not None and qw.qweight.shape[1] % 32 == 0 else None

    def run(x2: torch.Tensor) -> torch.Tensor:
        if decode is not None and x2.shape[0] <= DECODE_ROWS:
            return decode(x2)
        return torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), w_int8, scales)
    return run, decode


_CPU_PLANS = {4: _int4_plan, 8: _int8_plan}


@functools.lru_cache(maxsize=None)
def cpu_kernel_problem(bits: int) -> Optional[str]:
    """None when PyTorch's packed CPU kernel for `bits`-bit weights exists here and multiplies a small
    probe weight as the reference (dequantize, fp32 matmul) does; otherwise why not. Checked once
    per process, at the first load, so that a PyTorch without the op, or with a changed one, falls
    back to the reference path instead of failing or computing garbage."""
    if bits not in CPU_KERNEL_OPS:
        return f"no packed CPU kernel for {bits}-bit"
    missing = [op for op in CPU_KERNEL_OPS[bits] if not hasattr(torch.ops.aten, op)]
    if missing:
        return f"this PyTorch ({torch.__version__}) has no torch.ops.aten.{missing[0]}"
    qw, x = _probe_case(bits)
    try:
        cpu = torch.device("cpu")  # PyTorch's op itself, not the decode kernel that serves few rows
        got = _CPU_PLANS[bits](qw, cpu, decode_kernel=False)[0](x).float()
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
        return f"its {bits}-bit CPU kernel failed on a probe ({first_line(e)})"
    want = F.linear(x.float(), qw.dequantize())
    # the kernels round to bf16 (2**-8 relative); a changed layout is off by the values' own size
    if got.shape != want.shape or not bool((got - want).abs().max() <= 0.02 * want.abs().max()):
        return f"its {bits}-bit CPU kernel disagrees with the reference on a probe"
    return None


def _probe_case(bits: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A 32x128 weight (asymmetric groups of 32 at 4 bits, symmetric per-channel at 8, power-of-two
    scales) and a [3, 128] bf16-representable input: every kernel constraint met, values exact in bf16."""
    gen = torch.Generator().manual_seed(0)
    n, k, groups = 32, 128, (4 if bits == 4 else 1)
    scales = 2.0 ** -torch.randint(0, 4, (n, groups), generator=gen).float()
    zeros = (torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.int32) if bits == 4
             else torch.full((n, 1), 128, dtype=torch.int32))
    qw = QuantizedWeight(qweight=torch.randint(0, 2 ** bits, (n, k), generator=gen).to(torch.uint8), scales=scales,
                         zeros=zeros, g_idx=torch.arange(k, dtype=torch.int32) // (k // groups), bits=bits,
                         group_size=-1 if groups == 1 else k // groups, sym=bits == 8)
    return qw, torch.randn(3, k, generator=gen).to(torch.bfloat16)


class CpuBackend:
    name = "cpu"

    def __init__(self, qw: QuantizedWeight, device: torch.device):
        if device.type != "cpu":
            raise QuantkitError(f"the cpu backend needs the layer on the CPU, not {device}")
        self.n, self.k = qw.qweight.shape
        self.kernel, self.fallback = None, None
        self.decode_gemv = None  # kernels.cpu_gemv's kernel on unpermuted input, for the engine's C decode step
        reason = cpu_kernel_problem(qw.bits)
        if reason is None:
            try:
                self.kernel, self.decode_gemv = _CPU_PLANS[qw.bits](qw, device)
            except (ValueError, RuntimeError) as e:  # shape or layout the kernel refuses
                reason = f"{qw.bits}-bit CPU kernel unusable ({e})"
        if self.kernel is None:
            notice(f"quantkit cpu backend: {reason}; using a cached dequantized weight")
            self.fallback = DequantizedBackend(qw, device)

    def matmul_fn(self, dtype: torch.dtype) -> Callable:
        """``x [M, in] -> [M, out]`` in `dtype`, without ``__call__``'s shape handling: for loops that call
        a layer thousands of times with one small row (the engine's CPU decode), where that costs as
        much as the kernel's own set-up. PyTorch's kernels compute in bf16 whatever `dtype` is, the
        decode kernels in fp32 (int8 activations), so the output is cast to `dtype` (a no-op when equal)."""
        if self.fallback is not None:
            return self.fallback
        kernel = self.kernel
        return lambda x2: kernel(x2).to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fallback is not None:
            return self.fallback(x)
        x2 = _flat(x, self.k)
        if x2.shape[0] == 0:
            return x.new_zeros(*x.shape[:-1], self.n)
        return self.kernel(x2).to(x.dtype).reshape(*x.shape[:-1], self.n)


class TritonBackend:
    """quantkit.kernels' dequant-GEMM on the gptq layout. Any format is repacked to gptq once here
    (formats.gptq.pack, the same packer the writer uses), with act-order rows sorted by group so
    the kernel always sees contiguous groups; the activation columns are permuted per call."""

    name = "triton"

    def __init__(self, qw: QuantizedWeight, device: torch.device):
        from quantkit.formats import gptq
        from quantkit.kernels import dequant_gemm, triton_support

        self.n, self.k = qw.qweight.shape
        self.fallback = None
        reason = None
        if not triton_support.triton_available():
            reason = "triton cannot run here (no CUDA device and TRITON_INTERPRET unset)"
        elif qw.bits not in (4, 8):
            reason = f"no Triton kernel for {qw.bits}-bit"
        else:
            try:
                perm, codes, gs = _contiguous_groups(qw)
            except ValueError as e:
                reason = f"Triton kernel unusable ({e})"
        if reason is not None:
            notice(f"quantkit triton backend: {reason}; using a cached dequantized weight")
            self.fallback = DequantizedBackend(qw, device)
            return
        n_groups = self.k // gs
        contiguous = QuantizedWeight(qweight=codes, scales=qw.scales, zeros=qw.zeros,
                                     g_idx=torch.arange(self.k, dtype=torch.int32) // gs, bits=qw.bits,
                                     group_size=-1 if n_groups == 1 else gs, sym=qw.sym)
        packed = gptq.pack(contiguous)
        self.qweight = packed["qweight"].to(device)
        self.qzeros = packed["qzeros"].to(device)
        self.scales = packed["scales"].to(device)
        self.perm = None if perm is None else perm.to(device)
        self.bits, self.group_size = qw.bits, gs
        self.kernel = dequant_gemm.dequant_gemm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fallback is not None:
            return self.fallback(x)
        return self.kernel(x, self.qweight, self.scales.to(x.dtype), self.qzeros, None, self.bits, self.group_size,
                           perm=self.perm)


_CLASSES = {"reference": ReferenceBackend, "cpu": CpuBackend, "triton": TritonBackend}


def matmul_fn(impl, dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> Callable:
    """A built backend `impl` (plus `bias`, added in the output's dtype as ``QuantLinear.forward``
    does) as one callable on 2-D activations in `dtype`."""
    direct = getattr(impl, "matmul_fn", None)
    mm = direct(dtype) if direct is not None else impl
    if bias is None:
        return mm

    def with_bias(x2: torch.Tensor) -> torch.Tensor:
        y = mm(x2)
        return y + bias.to(y.dtype)
    return with_bias


def build(name: str, qw: QuantizedWeight, device: torch.device):
    """Backend `name` (already resolved from "auto") for weight `qw` living on `device`.
    W8A8 weights (``qw.input_quant``) get the int8-activation backends of `runtime.w8a8`."""
    if qw.input_quant is not None:
        from quantkit.runtime import w8a8

        return w8a8.CLASSES[name](qw, device)
    return _CLASSES[name](qw, device)
