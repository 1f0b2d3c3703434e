"""W8A8 in Triton: dynamic per-token int8 activation quantization and an int8 x int8 GEMM.

* :func:`per_token_quant_int8` - one fused pass per row (absmax, scale, round, clamp, store), so
  activations are read twice from cache at most and never written in fp32.
* :func:`int8_gemm` - ``tl.dot`` int8 x int8 -> int32 (exact accumulation, tensor cores on GPU),
  then the epilogue ``acc * x_scale[m] * w_scale[n] + bias[n]`` in fp32, stored in ``out_dtype``.

Weight layout: ``w_q`` is ``[N, K]`` int8, row-major - the ``nn.Linear`` layout and the one
compressed-tensors ``int-quantized`` checkpoints store, so no transpose at load. The kernel reads it
through strides as a ``[K, N]`` operand.

Rounding matches ``torch.round`` (half to even) exactly; division uses ``div_rn`` (IEEE round to
nearest) so GPU results equal the fp32 reference bit for bit, like the interpreter's.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .reference import quantize_per_token_int8, w8a8_reference

from . import triton_support
from .triton_support import HAS_TRITON, INTERPRET, tl, triton

# int8 dot needs K >= 32 per tile on NVIDIA; keep every dim >= 16 (the GPU minimum) even here.
_INTERP_GEMM_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4)
# with QUANTKIT_TRITON_AUTOTUNE=0 on GPU: one candidate of the tuned set
_FIXED_GEMM_CONFIG = triton_support.fixed_config(_INTERP_GEMM_CONFIG,
                                                 dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8))
_QUANT_MAX_BLOCK = 4096


def _m_bucket(m: int) -> int:
    return min(1 << max(0, int(m) - 1).bit_length(), 4096)


if HAS_TRITON:

    @triton.jit
    def _round_half_even(v):
        """``torch.round`` semantics without libdevice (unsupported by the interpreter)."""
        f = tl.floor(v)
        d = v - f  # exact
        odd = f - 2.0 * tl.floor(f * 0.5)  # 1.0 if f is odd else 0.0
        return tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, f + odd))

    @triton.jit
    def _per_token_quant_kernel(
        x_ptr, q_ptr, s_ptr, K, stride_xm, stride_xk, stride_qm,
        BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
    ):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        x_row = x_ptr + row.to(tl.int64) * stride_xm
        q_row = q_ptr + row.to(tl.int64) * stride_qm
        if ONE_PASS:
            x = tl.load(x_row + offs * stride_xk, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=0)
        else:
            amax_v = tl.zeros((BLOCK,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                xk = tl.load(x_row + (k0 + offs) * stride_xk, mask=k0 + offs < K, other=0.0)
                amax_v = tl.maximum(amax_v, tl.abs(xk.to(tl.float32)))
            amax = tl.max(amax_v, axis=0)
        scale = tl.math.div_rn(amax, 127.0)
        safe = tl.where(scale == 0.0, 1.0, scale)
        if ONE_PASS:
            q = _round_half_even(tl.math.div_rn(x, safe))
            q = tl.minimum(tl.maximum(q, -128.0), 127.0)
            tl.store(q_row + offs, q.to(tl.int8), mask=offs < K)
        else:
            for k0 in range(0, K, BLOCK):
                xk = tl.load(x_row + (k0 + offs) * stride_xk, mask=k0 + offs < K, other=0.0)
                q = _round_half_even(tl.math.div_rn(xk.to(tl.float32), safe))
                q = tl.minimum(tl.maximum(q, -128.0), 127.0)
                tl.store(q_row + k0 + offs, q.to(tl.int8), mask=k0 + offs < K)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _int8_gemm_kernel(
        a_ptr, b_ptr, xs_ptr, ws_ptr, bias_ptr, c_ptr,
        M, N, K, M_BUCKET,
        stride_am, stride_ak, stride_bn, stride_bk, stride_xs, stride_ws, stride_cm, stride_cn,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=m_mask[:, None] & k_mask[None, :], other=0)
            # w is [N, K]; read it as the [K, N] operand through strides
            b = tl.load(b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                        mask=k_mask[:, None] & n_mask[None, :], other=0)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        xs = tl.load(xs_ptr + offs_m * stride_xs, mask=m_mask, other=0.0).to(tl.float32)
        ws = tl.load(ws_ptr + offs_n * stride_ws, mask=n_mask, other=0.0).to(tl.float32)
        y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                 y.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    def _gemm_configs():
        return [
            triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8), num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in [
                (16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 128, 4, 4), (64, 128, 128, 4, 3),
                (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (64, 256, 128, 8, 3), (256, 128, 64, 8, 3),
            ]
        ]

    _int8_gemm_tuned = None if INTERPRET else triton.autotune(
        configs=_gemm_configs(), key=["M_BUCKET", "N", "K"]
    )(_int8_gemm_kernel)


def per_token_quant_int8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-token int8: ``x [..., K]`` -> ``(x_q int8 [M, K], scale fp32 [M, 1])``.

    Same semantics as :func:`quantize_per_token_int8` (its fallback): ``scale = absmax / 127``,
    round half to even, clamp ``[-128, 127]``; zero rows give scale 0.
    """
    if not triton_support.runs_for(x):
        return quantize_per_token_int8(x)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        s.zero_()
        return q, s
    block = min(1 << max(0, k - 1).bit_length(), _QUANT_MAX_BLOCK)
    _per_token_quant_kernel[(m,)](
        x2, q, s, k, x2.stride(0), x2.stride(1), q.stride(0),
        BLOCK=block, ONE_PASS=k <= block,
    )
    return q, s


def int8_gemm(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.float16,
    *,
    config: Optional[dict] = None,
) -> torch.Tensor:
    """``(x_q @ w_q.T) * x_scale * w_scale (+ bias)`` with int32 accumulation.

    ``x_q [M, K]`` int8, ``w_q [N, K]`` int8 (nn.Linear layout), ``x_scale [M, 1]`` (or ``[M]``),
    ``w_scale [N]`` (or ``[N, 1]`` / ``[1, N]``), ``bias [N]``. Returns ``[M, N]`` in ``out_dtype``.
    Falls back to :func:`w8a8_reference` when Triton cannot run on the inputs' device.
    """
    if x_q.dtype != torch.int8 or w_q.dtype != torch.int8:
        raise ValueError(f"int8_gemm expects int8 inputs, got {x_q.dtype} and {w_q.dtype}")
    if x_q.dim() != 2 or w_q.dim() != 2:
        raise ValueError("int8_gemm expects x_q [M, K] and w_q [N, K]")
    m, k = x_q.shape
    n = w_q.shape[0]
    if w_q.shape[1] != k:
        raise ValueError(f"K mismatch: x_q {tuple(x_q.shape)} vs w_q [N, K] {tuple(w_q.shape)}")
    if x_scale.numel() != m or w_scale.numel() != n:
        raise ValueError(f"x_scale needs {m} entries and w_scale {n}; got {x_scale.numel()}, {w_scale.numel()}")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"bias needs {n} entries, got {bias.numel()}")
    if not triton_support.runs_for(x_q):
        return w8a8_reference(x_q, w_q, x_scale, w_scale, bias, out_dtype)
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    xs = x_scale.reshape(-1)
    ws = w_scale.reshape(-1)
    b = bias.reshape(-1) if bias is not None else ws  # dummy pointer when HAS_BIAS=False
    args = (
        x_q, w_q, xs, ws, b, out, m, n, k, _m_bucket(m),
        x_q.stride(0), x_q.stride(1), w_q.stride(0), w_q.stride(1), xs.stride(0), ws.stride(0),
        out.stride(0), out.stride(1),
    )
    cfg = config if config is not None else _FIXED_GEMM_CONFIG
    if cfg is not None:
        cfg = {"GROUP_M": 8, **cfg}
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        _int8_gemm_kernel[grid](*args, HAS_BIAS=bias is not None, **cfg)
    else:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _int8_gemm_tuned[grid](*args, HAS_BIAS=bias is not None)
    return out


def w8a8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Convenience: quantize ``x [..., K]`` per token, ``int8_gemm``, reshape; output in ``x.dtype``."""
    lead = x.shape[:-1]
    x_q, x_s = per_token_quant_int8(x)
    y = int8_gemm(x_q, w_q, x_s, w_scale, bias, out_dtype=x.dtype)
    return y.reshape(*lead, w_q.shape[0])
