"""W8A8 backends for `QuantLinear`: int8 activations x int8 weights, exact int32 accumulation.

y = (q_x @ q_w^T) * s_x[m] * s_w[n], with q_x the int8 input (dynamic per token: s_x = absmax/127,
vLLM's convention; or static per tensor: the checkpoint's input_scale), x / s_x rounded half to even
and clamped to [-128, 127] exactly as `quantkit.kernels` do (vLLM multiplies by 127/absmax instead:
the same codes up to rare last-bit ties). transformers + compressed-tensors fake-quantize dynamic
inputs with absmax/127.5 instead, so their logits differ slightly (tests/test_smoothquant.py).

- reference: fake-quantize the input the same way, dequantize both sides, fp32 F.linear. The oracle.
- cpu: the int32 accumulator computed exactly, then one fp32 epilogue. Two exact ways to get it,
  bit-identical by construction (``QUANTKIT_W8A8_CPU_GEMM``):
    "fp32" (default): fp32 BLAS on the int8 codes in K-chunks of 1024. Every product is an integer
      of magnitude <= 2**14 and every partial sum of a chunk <= 2**24, so each addition is exact
      whatever order or FMA the BLAS uses; chunks are summed in int32. Needs an fp32 copy of the
      codes (4 B/weight) but runs at BLAS speed.
    "int_mm": ``torch._int_mm`` (int8 x int8 -> int32); keeps only int8 weights. In torch 2.13 on
      CPU it takes any shape (M = 1, odd K/N checked), but on AVX2 machines without VNNI it is a
      scalar loop, measured 10-25x slower than fp32 matmul (scripts/bench_w8a8.py). A private op:
      probed once (`int_mm_problem`); where missing or wrong, "fp32" is used with a notice.
- triton: quantkit.kernels' per_token_quant_int8 + int8_gemm; falls back to "cpu" semantics
  (never to a weight-only matmul) where Triton cannot run.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError, first_line
from quantkit.notices import notice
from quantkit.qtensor import QuantizedWeight

CPU_GEMMS = ("fp32", "int_mm")
EXACT_CHUNK = 1024  # 1024 * 128 * 128 = 2**24: the largest fp32-exact int8 dot-product length


def cpu_gemm_default() -> str:
    name = os.environ.get("QUANTKIT_W8A8_CPU_GEMM", "fp32").strip().lower()
    if name not in CPU_GEMMS:
        raise QuantkitError(f"QUANTKIT_W8A8_CPU_GEMM={name!r}; choose one of {', '.join(CPU_GEMMS)}")
    return name


def weight_int8(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed int8 codes [N, K] and fp32 per-channel scales [N] of an 8-bit symmetric per-channel weight."""
    try:
        if qw.n_groups != 1:
            raise ValueError(f"{qw.n_groups} groups per row")
        codes = qw.signed_int8()
    except ValueError as e:
        raise QuantkitError(f"W8A8 needs 8-bit symmetric per-channel weights ({e})") from None
    return codes, qw.scales[:, 0].float().contiguous()


@functools.lru_cache(maxsize=None)
def int_mm_problem() -> Optional[str]:
    """None when ``torch._int_mm`` (a private op) exists and gives exact int32 products on a small
    probe (M = 1 and 5, K and N not multiples of 16); otherwise why not. Checked once per process."""
    if not hasattr(torch, "_int_mm"):
        return f"this PyTorch ({torch.__version__}) has no torch._int_mm"
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-128, 128, (24, 72), generator=gen).to(torch.int8)
    for m in (1, 5):
        codes = torch.randint(-128, 128, (m, 72), generator=gen).to(torch.int8)
        try:
            got = torch._int_mm(codes, w.t())
        except (RuntimeError, TypeError, NotImplementedError) as e:
            return f"torch._int_mm failed on a probe ({first_line(e)})"
        if got.dtype != torch.int32 or not torch.equal(got.long(), codes.long() @ w.long().t()):
            return "torch._int_mm disagrees with exact integer products on a probe"
    return None


def quantize_input(x2: torch.Tensor, input_quant: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes (held in fp32, integer-valued) [M, K] and fp32 scales [M, 1] of a 2-D input.

    The semantics of ``quantkit.kernels.per_token_quant_int8``: scale = max|x| / 127 per token (or
    the static scale), x / scale rounded half to even, clamped to [-128, 127]; zero rows get scale 0.
    """
    xf = x2.float()
    if input_quant["strategy"] == "token":
        s = torch.linalg.vector_norm(xf, ord=float("inf"), dim=1, keepdim=True) / 127.0  # max|x|, one pass
        safe = torch.where(s == 0, torch.ones_like(s), s)
    else:
        s = safe = input_quant["scale"].to(device=x2.device, dtype=torch.float32).reshape(1, 1).expand(x2.shape[0], 1)
    return torch.div(xf, safe).round_().clamp_(-128, 127), s


def int8_matmul(codes: torch.Tensor, w: torch.Tensor, gemm: str = "fp32", w_float: torch.Tensor | None = None) -> torch.Tensor:
    """The exact accumulator of int8 ``codes [M, K] @ w [N, K]^T`` (codes as int8 or integer-valued fp32).

    Returns int32, except the "fp32" gemm with K <= 1024, whose fp32 result already holds the exact
    integers (converting costs a pass, so callers convert only when they need int32)."""
    if gemm == "int_mm":
        return torch._int_mm(codes if codes.dtype == torch.int8 else codes.to(torch.int8), w.t())
    wf = w.float() if w_float is None else w_float
    cf = codes.float()
    k = cf.shape[1]
    if k <= EXACT_CHUNK:
        return F.linear(cf, wf)
    acc = None
    for start in range(0, k, EXACT_CHUNK):
        part = F.linear(cf[:, start:start + EXACT_CHUNK], wf[:, start:start + EXACT_CHUNK]).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    return acc


class W8A8Reference:
    """Fake-quantized input and dequantized weight in fp32, F.linear: the oracle, written plainly."""

    name = "reference"

    def __init__(self, qw: QuantizedWeight, device: torch.device):
        self.n = qw.qweight.shape[0]
        self.w = qw.dequantize(torch.float32).to(device)
        self.input_quant = qw.input_quant

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        q, s = quantize_input(x2, self.input_quant)
        y = F.linear(q * s, self.w)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.n)


class W8A8Cpu:
    name = "cpu"

    def __init__(self, qw: QuantizedWeight, device: torch.device, gemm: str | None = None):
        if device.type != "cpu":
            raise QuantkitError(f"the cpu backend needs the layer on the CPU, not {device}")
        self.n = qw.qweight.shape[0]
        self.w, self.w_scale = weight_int8(qw)
        self.gemm = gemm or cpu_gemm_default()
        if self.gemm == "int_mm" and int_mm_problem() is not None:
            notice(f"quantkit cpu backend: {int_mm_problem()}; W8A8 layers use the exact fp32 GEMM instead")
            self.gemm = "fp32"
        self.w_float = self.w.float() if self.gemm == "fp32" else None
        self.input_quant = qw.input_quant

    def accumulate(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 accumulator [M, N], fp32 input scales [M, 1]) for a 2-D input."""
        q, s = quantize_input(x2, self.input_quant)
        return int8_matmul(q, self.w, self.gemm, self.w_float).to(torch.int32), s

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] == 0:
            return x.new_zeros(*x.shape[:-1], self.n)
        q, s = quantize_input(x2, self.input_quant)
        acc = int8_matmul(q, self.w, self.gemm, self.w_float)
        y = acc.float() * s * self.w_scale
        return y.to(x.dtype).reshape(*x.shape[:-1], self.n)


class W8A8Triton:
    name = "triton"

    def __init__(self, qw: QuantizedWeight, device: torch.device):
        from quantkit.kernels import int8_gemm, triton_support

        self.fallback = None
        if not triton_support.triton_available():
            notice("quantkit triton backend: triton cannot run here (no CUDA device and TRITON_INTERPRET unset); "
                   "W8A8 layers keep int8 activations through the cpu (or reference) path")
            self.fallback = W8A8Cpu(qw, device) if device.type == "cpu" else W8A8Reference(qw, device)
            return
        self.kernels = int8_gemm
        self.n = qw.qweight.shape[0]
        w, ws = weight_int8(qw)
        self.w, self.w_scale = w.to(device), ws.to(device)
        self.input_quant = qw.input_quant

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fallback is not None:
            return self.fallback(x)
        x2 = x.reshape(-1, x.shape[-1])
        if self.input_quant["strategy"] == "token":
            q, s = self.kernels.per_token_quant_int8(x2)
        else:
            q, s = quantize_input(x2, self.input_quant)
            q = q.to(torch.int8)
        y = self.kernels.int8_gemm(q, self.w, s, self.w_scale, None, out_dtype=x.dtype)
        return y.reshape(*x.shape[:-1], self.n)


CLASSES = {"reference": W8A8Reference, "cpu": W8A8Cpu, "triton": W8A8Triton}
