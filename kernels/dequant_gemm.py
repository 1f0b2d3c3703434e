"""Weight-only quantized GEMM (W4A16 / W8A16) on GPTQ-packed weights, in Triton.

``y = x @ W`` with ``W[k, n] = scales[g, n] * (q[k, n] - zero[g, n])``, ``g = k // group_size``.
The weight is never materialised: each program loads packed int32 words once, unpacks them in
registers (shift + mask), dequantizes in fp32 and multiplies, accumulating in fp32.

Two paths, chosen by M (rows of x), because the two regimes are limited by different things:

* ``M <= 16`` (decode): memory-bound. A 1 x K x N product has only ``N / BLOCK_N`` output tiles,
  too few to fill the GPU, so K is also split across programs (``SPLIT_K``) and the partial sums
  are ``tl.atomic_add``-ed into a zeroed fp32 buffer, cast to ``x.dtype`` at the end.
  ``M == 1`` reduces with ``tl.sum`` (a GEMV, ``BLOCK_M = 1``); ``2 <= M <= 16`` uses ``tl.dot`` on
  rows padded to 16, since tensor-core FLOPs are free when the weight stream is the bottleneck.
* ``M > 16``: a classic tiled ``tl.dot`` GEMM (all dot dims >= 16), grouped program order for L2.

Layout (GPTQ v1): ``qweight [K/pf, N]`` int32 packed along K LSB first, ``qzeros [G, N/pf]``
packed along N storing ``zero - 1``, ``scales [G, N]``. ``qzeros=None`` means symmetric with the
implicit zero ``2**(bits-1)``.

Act-order checkpoints (``desc_act``, non-trivial ``g_idx``) are handled by reordering the weight
rows once at load with :func:`prepare_act_order`; at run time x's columns are permuted, so the
kernel only ever sees contiguous groups (no per-element scale gather on the hot path).

Autotuning: on GPU a small config set keyed on ``(M_BUCKET, N, K, BITS)`` with ``M_BUCKET`` = M rounded
up to a power of two. Under ``TRITON_INTERPRET=1`` a single fixed config is used, because the
autotuner needs a GPU to time configs; ``QUANTKIT_TRITON_AUTOTUNE=0`` takes one fixed GPU config too.

Configs chosen ahead of time (issue #49): :func:`pin_config` fixes the config of one call shape
(at load or warm-up), and the config the autotuner picks for a shape is pinned the same way after
its first call, so every later call of that shape, and a CUDA graph captured after the warm-up,
launches the kernel directly: no autotuner lookup, never a timing run at call time.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .reference import (
    SUPPORTED_BITS,
    pack_gptq_qweight,
    unpack_gptq_qweight,
    w4a16_reference,
)

from . import triton_support
from .triton_support import HAS_TRITON, INTERPRET, tl, triton

SMALL_M_MAX = 16  # rows at or below this take the split-K path

# Fixed configs for the interpreter. BLOCK_K=64 makes group 32 take the per-row scale path and
# 64/128/per-channel the per-block path, so both are exercised by tests.
_INTERP_SPLITK_CONFIG = dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=2)
_INTERP_TILED_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, GROUP_M=4)
# Fixed GPU configs when autotuning is off (QUANTKIT_TRITON_AUTOTUNE=0). The tiled one is small
# because it must fit every activation dtype and group: on an H200 (triton 3.6), 64 x 128 x 64 tiles
# in 3 stages needed 352 KiB of shared memory with fp32 activations and 248 KiB with fp16 at groups
# 32 and 64 (limit 227 KiB); the autotuner skips such configs, a fixed one cannot. 32 x 64 x 64 in 2
# stages compiles (triton 3.9, sm_90, ahead of time) to 29 % of what that one did, and keeps
# BLOCK_K = 64 so that group 32 still takes the per-row scale path.
_GPU_SPLITK_CONFIG = dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=4)
_GPU_TILED_CONFIG = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_stages=2)
_FIXED_SPLITK_CONFIG = triton_support.fixed_config(_INTERP_SPLITK_CONFIG, _GPU_SPLITK_CONFIG)
_FIXED_TILED_CONFIG = triton_support.fixed_config(_INTERP_TILED_CONFIG, _GPU_TILED_CONFIG)


def _next_pow2(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


def _m_bucket(m: int) -> int:
    """Autotune key: M rounded up to a power of two, capped (large M all tune alike)."""
    return min(_next_pow2(m), 4096)


if HAS_TRITON:

    @triton.jit
    def _load_dequant_tile(
        qw_ptr, s_ptr, qz_ptr, k0, offs_n, N, K,
        stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
        BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """fp32 tile ``W[k0:k0+BLOCK_K, offs_n]``; each packed word is loaded exactly once."""
        PF: tl.constexpr = 32 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        ZERO: tl.constexpr = 1 << (BITS - 1)
        n_mask = offs_n < N
        offs_w = k0 // PF + tl.arange(0, BLOCK_K // PF)
        words = tl.load(
            qw_ptr + offs_w[:, None] * stride_qk + offs_n[None, :] * stride_qn,
            mask=(offs_w[:, None] < K // PF) & n_mask[None, :], other=0,
        )
        shifts = tl.arange(0, PF) * BITS
        # [words, PF, N] -> [K, N]: row w*PF + j is value j of word w (LSB first)
        q = (words[:, None, :] >> shifts[None, :, None]) & MASK
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))
        if GROUP_SIZE % BLOCK_K == 0:
            # the whole K block lies in one group: one scale/zero row per block
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0)
            s = s.to(tl.float32)
            if HAS_ZEROS:
                zw = tl.load(qz_ptr + g * stride_zg + (offs_n // PF) * stride_zn, mask=n_mask, other=0)
                z = ((zw >> ((offs_n % PF) * BITS)) + 1) & MASK
                w = (q - z[None, :]).to(tl.float32) * s[None, :]
            else:
                w = (q - ZERO).to(tl.float32) * s[None, :]
        else:
            # groups smaller than the block (or K not a multiple of it): per-row group index
            offs_k = k0 + tl.arange(0, BLOCK_K)
            g = offs_k // GROUP_SIZE
            m2 = (offs_k < K)[:, None] & n_mask[None, :]
            s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=m2, other=0.0)
            s = s.to(tl.float32)
            if HAS_ZEROS:
                zw = tl.load(qz_ptr + g[:, None] * stride_zg + (offs_n // PF)[None, :] * stride_zn,
                             mask=m2, other=0)
                z = ((zw >> ((offs_n % PF) * BITS)[None, :]) + 1) & MASK
                w = (q - z).to(tl.float32) * s
            else:
                w = (q - ZERO).to(tl.float32) * s
        return w

    @triton.jit
    def _dequant_splitk_kernel(
        x_ptr, qw_ptr, s_ptr, qz_ptr, out_ptr,
        M, N, K, M_BUCKET,
        stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
        stride_om, stride_on,
        BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr,
        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    ):
        """Decode path: program (n-block, k-split) walks K blocks pid_k, pid_k+SPLIT_K, ...

        ``out_ptr`` is a zeroed fp32 [M, N] buffer; partial sums are atomically added.
        """
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        num_kb = tl.cdiv(K, BLOCK_K)
        n_iter = tl.cdiv(num_kb - pid_k, SPLIT_K)
        for i in range(0, n_iter):
            k0 = (pid_k + i * SPLIT_K) * BLOCK_K
            w = _load_dequant_tile(
                qw_ptr, s_ptr, qz_ptr, k0, offs_n, N, K,
                stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
                BITS, GROUP_SIZE, HAS_ZEROS, BLOCK_K, BLOCK_N,
            )
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0,
            )
            if BLOCK_M >= 16:
                acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
            else:
                acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
        tl.atomic_add(
            out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, acc,
            mask=m_mask[:, None] & (offs_n < N)[None, :],
        )

    @triton.jit
    def _dequant_tiled_kernel(
        x_ptr, qw_ptr, s_ptr, qz_ptr, y_ptr,
        M, N, K, M_BUCKET,
        stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
        stride_ym, stride_yn,
        BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """Prefill path: tiled GEMM, dequantized tile cast to x's dtype for ``tl.dot``."""
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        # grouped ordering: GROUP_M row-blocks share weight column-blocks while they are in L2
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0,
            )
            w = _load_dequant_tile(
                qw_ptr, s_ptr, qz_ptr, k0, offs_n, N, K,
                stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
                BITS, GROUP_SIZE, HAS_ZEROS, BLOCK_K, BLOCK_N,
            )
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
        tl.store(
            y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
            acc.to(y_ptr.dtype.element_ty),
            mask=m_mask[:, None] & (offs_n < N)[None, :],
        )

    def _splitk_configs():
        cfgs = []
        for bn, bk, sk, warps in [
            (64, 128, 8, 4), (128, 128, 4, 4), (128, 64, 8, 4), (64, 64, 16, 4),
            (256, 64, 4, 8), (128, 128, 16, 4), (256, 128, 2, 8), (32, 128, 16, 4),
        ]:
            cfgs.append(triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk), num_warps=warps, num_stages=3))
        return cfgs

    def _tiled_configs():
        cfgs = []
        for bm, bn, bk, warps, stages in [
            (32, 64, 64, 4, 4), (32, 128, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 128, 4, 3),
            (128, 128, 64, 8, 3), (128, 256, 32, 8, 3), (64, 256, 64, 8, 3), (128, 128, 32, 4, 4),
        ]:
            cfgs.append(triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8),
                                      num_warps=warps, num_stages=stages))
        return cfgs

    if INTERPRET:
        _splitk_tuned = None
        _tiled_tuned = None
    else:
        _splitk_tuned = triton.autotune(
            configs=_splitk_configs(), key=["M_BUCKET", "N", "K", "BITS"], reset_to_zero=["out_ptr"],
        )(_dequant_splitk_kernel)
        _tiled_tuned = triton.autotune(configs=_tiled_configs(), key=["M_BUCKET", "N", "K", "BITS"])(
            _dequant_tiled_kernel
        )


# (path, M_BUCKET, N, K, BITS, GROUP_SIZE, zeros?, x dtype, scales dtype) -> launch config (block sizes,
# num_warps, num_stages): set by pin_config or after the autotuner's first call of a shape
_PINNED: dict[tuple, dict] = {}


def config_key(m: int, n: int, k: int, bits: int, group_size: int, has_zeros: bool, x_dtype: torch.dtype,
               scales_dtype: torch.dtype) -> tuple:
    """The shape a pinned config is for: the GEMM path M takes (split-K up to SMALL_M_MAX rows,
    tiled above), M's autotune bucket, N, K, bits, group size (K when per-channel), zeros, dtypes."""
    path = "splitk" if m <= SMALL_M_MAX else "tiled"
    return (path, _m_bucket(m), n, k, bits, group_size, bool(has_zeros), x_dtype, scales_dtype)


def pin_config(key: tuple, config: dict) -> None:
    """Launch every later :func:`dequant_gemm` call of shape ``key`` (:func:`config_key`) with
    ``config``: ``BLOCK_N``, ``BLOCK_K``, ``SPLIT_K`` for the split-K path; ``BLOCK_M``,
    ``BLOCK_N``, ``BLOCK_K`` (``GROUP_M``) for the tiled one; optionally ``num_warps`` / ``num_stages``."""
    need = ("BLOCK_N", "BLOCK_K", "SPLIT_K") if key[0] == "splitk" else ("BLOCK_M", "BLOCK_N", "BLOCK_K")
    missing = [name for name in need if name not in config]
    if missing:
        raise ValueError(f"a {key[0]} config needs {', '.join(need)}; missing {', '.join(missing)}")
    _PINNED[key] = dict(config)


def pinned_configs() -> dict[tuple, dict]:
    """A copy of the pinned configs (those set by :func:`pin_config` and those the autotuner chose)."""
    return {key: dict(cfg) for key, cfg in _PINNED.items()}


def clear_pinned_configs() -> None:
    _PINNED.clear()


def _pin_autotuned(key: tuple, tuner) -> None:
    """Pin the config the autotuner just chose for ``key`` (Triton's ``Autotuner.best_config``)."""
    best = getattr(tuner, "best_config", None)
    if best is None:
        return
    cfg = dict(best.kwargs)
    for attr in ("num_warps", "num_stages"):
        if getattr(best, attr, None) is not None:
            cfg[attr] = getattr(best, attr)
    _PINNED[key] = cfg


def _resolve_group_size(group_size: Optional[int], k: int) -> int:
    if group_size is None or group_size <= 0 or group_size == k:
        return k
    return int(group_size)


def prepare_act_order(
    qweight: torch.Tensor, g_idx: torch.Tensor, bits: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reorder packed weight rows by group once, at load time.

    Returns ``(qweight_sorted, g_idx_sorted, perm)``: ``qweight_sorted`` holds rows ``perm`` of the
    original (re-packed, same layout), ``g_idx_sorted = g_idx[perm]`` is non-decreasing (contiguous
    groups), and ``x[..., perm] @ W_sorted == x @ W``. Pass ``perm=perm`` (and ``g_idx=None``) to
    :func:`dequant_gemm`. The sort is stable so a trivial ``g_idx`` gives the identity.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    codes = unpack_gptq_qweight(qweight, bits)
    if g_idx.numel() != codes.shape[0]:
        raise ValueError(f"g_idx has {g_idx.numel()} entries but qweight unpacks to K={codes.shape[0]}")
    g = g_idx.to(device=qweight.device, dtype=torch.long)
    perm = torch.argsort(g, stable=True)
    return pack_gptq_qweight(codes[perm], bits), g[perm].to(torch.int32), perm


def _check_contiguous_groups(g_sorted: torch.Tensor, k: int, group_size: int) -> None:
    expected = torch.arange(k, device=g_sorted.device) // group_size
    if not torch.equal(g_sorted.to(torch.long), expected):
        raise ValueError(
            "g_idx does not describe groups of exactly group_size rows each; the Triton kernel "
            "needs equal-size groups (true for GPTQ act-order). Use w4a16_reference instead."
        )


def dequant_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: Optional[torch.Tensor],
    g_idx: Optional[torch.Tensor],
    bits: int,
    group_size: Optional[int],
    *,
    perm: Optional[torch.Tensor] = None,
    config: Optional[dict] = None,
) -> torch.Tensor:
    """``y[..., N] = x[..., K] @ W`` for a GPTQ v1 packed weight (4 or 8 bits).

    * ``qzeros=None``: symmetric (zero ``2**(bits-1)``); else v1 packed zeros.
    * ``group_size`` None / -1 / K: per-channel. K must be a multiple of it and of ``32 // bits``.
    * ``g_idx``: None or trivial (``k // group_size``) is free. A non-trivial ``g_idx`` is sorted
      here on every call (correct but slow); on the hot path call :func:`prepare_act_order` once
      and pass the sorted ``qweight`` with ``perm=perm`` and ``g_idx=None`` (or the sorted g_idx,
      which is then checked - a sync).
    * ``config``: fixed block sizes bypassing autotune (tests / debugging), e.g.
      ``{"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2}`` for M <= 16.

    Falls back to :func:`w4a16_reference` when Triton cannot run on ``x``'s device.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    pf = 32 // bits
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D int32 [K/{pf}, N], got {qweight.dtype} {tuple(qweight.shape)}")
    k = x.shape[-1]
    if k % pf:
        raise ValueError(f"K={k} must be a multiple of the pack factor {pf} for {bits}-bit weights")
    if qweight.shape[0] * pf != k:
        raise ValueError(f"x has K={k} but qweight {tuple(qweight.shape)} packs K={qweight.shape[0] * pf}")
    n = qweight.shape[1]
    gs = _resolve_group_size(group_size, k)
    if k % gs:
        raise ValueError(f"K={k} must be a multiple of group_size={gs}")
    n_groups = k // gs
    if tuple(scales.shape) != (n_groups, n):
        raise ValueError(f"scales must be [{n_groups}, {n}] for K={k}, group_size={gs}; got {tuple(scales.shape)}")
    if qzeros is not None and tuple(qzeros.shape) != (n_groups, -(-n // pf)):
        raise ValueError(f"qzeros must be [{n_groups}, {-(-n // pf)}]; got {tuple(qzeros.shape)}")
    if qzeros is not None and qzeros.dtype != torch.int32:
        raise ValueError(f"qzeros must be int32, got {qzeros.dtype}")

    if perm is None and g_idx is not None:
        trivial = torch.arange(k, device=g_idx.device) // gs
        if not torch.equal(g_idx.to(torch.long), trivial):
            qweight, g_sorted, perm = prepare_act_order(qweight, g_idx, bits)
            _check_contiguous_groups(g_sorted, k, gs)
    elif perm is not None and g_idx is not None:
        _check_contiguous_groups(g_idx, k, gs)  # must be the sorted g_idx from prepare_act_order
    if perm is not None:
        x = x.index_select(-1, perm.to(device=x.device))

    if not triton_support.runs_for(x):
        return w4a16_reference(x, qweight, scales, qzeros, None, bits, gs)

    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return torch.zeros(*lead, n, dtype=x.dtype, device=x.device)
    qz = qzeros if qzeros is not None else qweight  # dummy pointer, never read when HAS_ZEROS=False
    z_strides = (qzeros.stride(0), qzeros.stride(1)) if qzeros is not None else (0, 0)
    common = dict(
        BITS=bits, GROUP_SIZE=gs, HAS_ZEROS=qzeros is not None,
        # exact fp32 products for fp32 activations (no silent tf32); backend default otherwise
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
    )
    M_BUCKET = _m_bucket(m)
    key = config_key(m, n, k, bits, gs, qzeros is not None, x.dtype, scales.dtype)
    if config is None:
        config = _PINNED.get(key)

    if m <= SMALL_M_MAX:
        # M == 1: pure GEMV (tl.sum). 2..16: tl.dot on rows padded to 16 - a [BLOCK_M, BLOCK_K,
        # BLOCK_N] broadcast product spills registers on sm_90 for BLOCK_M >= 4 (checked with ptxas)
        block_m = 1 if m == 1 else 16
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
        cfg = config if config is not None else _FIXED_SPLITK_CONFIG
        call_args = (
            x2, qweight, scales, qz, out, m, n, k, M_BUCKET,
            x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1),
            scales.stride(0), scales.stride(1), *z_strides, out.stride(0), out.stride(1),
        )
        if cfg is not None:
            grid = (triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT_K"])
            _dequant_splitk_kernel[grid](*call_args, BLOCK_M=block_m, **common, **cfg)
        else:
            grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
            _splitk_tuned[grid](*call_args, BLOCK_M=block_m, **common)
            _pin_autotuned(key, _splitk_tuned)
        y = out if x.dtype == torch.float32 else out.to(x.dtype)
    else:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        cfg = config if config is not None else _FIXED_TILED_CONFIG
        call_args = (
            x2, qweight, scales, qz, y, m, n, k, M_BUCKET,
            x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1),
            scales.stride(0), scales.stride(1), *z_strides, y.stride(0), y.stride(1),
        )
        if cfg is not None:
            cfg = {"GROUP_M": 8, **cfg}
            grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
            _dequant_tiled_kernel[grid](*call_args, **common, **cfg)
        else:
            grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
            _tiled_tuned[grid](*call_args, **common)
            _pin_autotuned(key, _tiled_tuned)
    return y.reshape(*lead, n)
