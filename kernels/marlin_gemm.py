"""A split-K Triton W4A16 GEMM for few rows (decode, M <= 16) on Marlin's pre-shuffled layout.

**Untested on a GPU** (issue #49): no GPU was lent while it was written. It is checked for
correctness against :func:`marlin_layout.marlin_gemm_reference` under the Triton interpreter on CPU
(tests/test_marlin_layout.py) and compiled for sm_90 nowhere yet; its speed is unmeasured
(``scripts/bench_kernels.py`` has a row for it). It is a first step towards a Marlin-class kernel,
not one: it has Marlin's coalesced loads (each program reads whole 16 x 64 warp tiles, 512
contiguous bytes per k-tile) and split-K, but no hand-placed fragments, no asynchronous copy
pipeline of its own and no dequantization interleaved with the MMA beyond what Triton schedules.

Per program: ``BLOCK_N = 64`` columns (one warp tile wide) and the k-tiles of its share of K, ``KB``
16-row tiles at a time. The words of a k-block are loaded as [KB, 128] int32; word ``16 c + 4 r + j``
of a tile holds, at nibble ``4 e + 2 b + a``, the code of row ``8 a + 2 r + e`` and column
``16 j + 8 b + c`` (marlin_layout's step 2-3), so the codes come back in (k, n) order by one
reshape to [KB, c, r, j, e, b, a] and one permute to [KB, a, r, e, j, b, c]. Scales and zero points
are read through per-column indices made once at load (the layout permutes their columns).
Partial sums of the K splits are added atomically into a zeroed fp32 buffer, as dequant_gemm's
split-K path does.
"""
from __future__ import annotations

import functools

import torch

from . import triton_support
from .marlin_layout import INTERLEAVE, MarlinWeight, marlin_gemm_reference, marlin_permutations
from .triton_support import HAS_TRITON, tl, triton

MAX_ROWS = 16  # rows this kernel takes; more rows call marlin_gemm_reference (a tiled kernel is future work)


@functools.lru_cache(maxsize=None)
def _column_indices(n: int, grouped: bool, with_zeros: bool, device_str: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale_index [N], zero_index [N]) int32: where column n's scale sits in a row of the permuted
    scales, and which nibble of a row of the packed zeros holds its zero point."""
    _, scale_perm, scale_perm_single = marlin_permutations()
    order = scale_perm if grouped else scale_perm_single
    run = order.numel()
    inverse = torch.argsort(order)  # column i of a run is stored at position inverse[i]
    cols = torch.arange(n)
    stored = (cols // run) * run + inverse[cols % run]
    interleave_inverse = torch.tensor([INTERLEAVE.index(v) for v in range(8)])
    nibble = (stored // 8) * 8 + interleave_inverse[stored % 8]
    dev = torch.device(device_str)
    return stored.to(torch.int32).to(dev), nibble.to(torch.int32).to(dev)


if HAS_TRITON:

    @triton.jit
    def _marlin_splitk_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, sidx_ptr, zidx_ptr, out_ptr,
        M, N, K, K_TILES_PER_SPLIT,
        stride_xm, stride_qk, stride_sg, stride_zg, stride_om,
        GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, KB: tl.constexpr, BLOCK_M: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        BLOCK_K: tl.constexpr = 16 * KB
        offs_n = pid_n * 64 + tl.arange(0, 64)
        offs_w = pid_n * 128 + tl.arange(0, 128)  # the warp tile's words in a packed row
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        sidx = tl.load(sidx_ptr + offs_n)
        if HAS_ZEROS:
            zidx = tl.load(zidx_ptr + offs_n)
        # nibble 4 e + 2 b + a as three axes of 2: shifts in that order
        shifts = (tl.arange(0, 8) * 4).to(tl.int32)
        acc = tl.zeros([BLOCK_M, 64], dtype=tl.float32)
        kt_start = pid_k * K_TILES_PER_SPLIT
        kt_end = tl.minimum(kt_start + K_TILES_PER_SPLIT, K // 16)
        for kt in range(kt_start, kt_end, KB):
            offs_kt = kt + tl.arange(0, KB)
            kt_mask = offs_kt < kt_end
            words = tl.load(qw_ptr + offs_kt[:, None] * stride_qk + offs_w[None, :], mask=kt_mask[:, None], other=0)
            codes = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # [KB, 128, 8]
            codes = tl.reshape(codes, [KB, 8, 4, 4, 2, 2, 2])  # [kb, c, r, j, e, b, a]
            codes = tl.permute(codes, [0, 6, 2, 4, 3, 5, 1])  # [kb, a, r, e, j, b, c]
            w = tl.reshape(codes, [BLOCK_K, 64]).to(tl.float32)  # rows k of the block, columns n
            offs_k = kt * 16 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < kt_end * 16
            g = offs_k // GROUP_SIZE
            scale = tl.load(s_ptr + g[:, None] * stride_sg + sidx[None, :], mask=k_mask[:, None], other=0.0)
            if HAS_ZEROS:
                zw = tl.load(z_ptr + g[:, None] * stride_zg + (zidx // 8)[None, :], mask=k_mask[:, None], other=0)
                zero = ((zw >> ((zidx % 8) * 4)[None, :]) & 0xF).to(tl.float32)
            else:
                zero = 8.0
            w = (w - zero) * scale.to(tl.float32)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)
            if BLOCK_M == 1:
                acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
            else:
                acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
        tl.atomic_add(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc,
                      mask=m_mask[:, None] & (offs_n < N)[None, :])


def marlin_gemm(x: torch.Tensor, w: MarlinWeight, split_k: int = 4, kb: int = 4) -> torch.Tensor:
    """``x [..., K] @ W`` for a weight in Marlin's layout: the Triton kernel for up to 16 rows where
    Triton runs on x's device (or the interpreter is on), else :func:`marlin_gemm_reference`.
    ``split_k`` programs share K; ``kb`` 16-row k-tiles are loaded at a time (a power of two)."""
    if x.shape[-1] != w.k:
        raise ValueError(f"x has K={x.shape[-1]} but the weight has K={w.k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k).contiguous()
    m = x2.shape[0]
    if m == 0 or m > MAX_ROWS or not triton_support.runs_for(x):
        return marlin_gemm_reference(x, w)
    if kb < 1 or kb & (kb - 1):
        raise ValueError(f"kb must be a power of two, got {kb}")
    k_tiles = w.k // 16
    split_k = max(1, min(split_k, k_tiles))
    per_split = -(-k_tiles // split_k)
    per_split = -(-per_split // kb) * kb  # whole k-blocks per split
    split_k = -(-k_tiles // per_split)
    groups = w.k // w.group_size
    sidx, zidx = _column_indices(w.n, groups > 1, w.qzeros is not None, str(x.device))
    out = torch.zeros(m, w.n, dtype=torch.float32, device=x.device)
    zeros = w.qzeros if w.qzeros is not None else w.qweight  # dummy pointer, never read without zeros
    block_m = 1 if m == 1 else 16
    _marlin_splitk_kernel[(w.n // 64, split_k)](
        x2, w.qweight, w.scales, zeros, sidx, zidx, out,
        m, w.n, w.k, per_split,
        x2.stride(0), w.qweight.stride(0), w.scales.stride(0), zeros.stride(0), out.stride(0),
        GROUP_SIZE=w.group_size, HAS_ZEROS=w.qzeros is not None, KB=kb, BLOCK_M=block_m,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
    )
    y = out if x.dtype == torch.float32 else out.to(x.dtype)
    return y.reshape(*lead, w.n)
