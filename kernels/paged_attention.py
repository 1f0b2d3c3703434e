"""Paged decode attention: one new query token per sequence against K/V stored in fixed-size blocks.

Cache layout (shared with ``quantkit.engine.kv_cache``)::

    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim]   (model dtype, int8 or fp8 e4m3)
    k_scale, v_scale : [num_blocks, block_size, num_kv_heads] float32     (only for int8 / fp8 caches:
                                                                          x = q.float() * scale)
    block_tables     : [batch, max_blocks] int32, row b lists sequence b's blocks in order (padding
                       past the sequence's last block is never read)
    context_lens     : [batch] int32, tokens of sequence b in the cache (the new token included)

:func:`paged_attention_decode_reference` gathers each sequence's K/V by its block table and runs
softmax attention in fp32 (the test oracle). :func:`paged_attention_decode` runs the Triton kernel on
CUDA tensors (or on CPU tensors under ``TRITON_INTERPRET=1``) and falls back to the reference
otherwise.

:func:`decode_slots` + :func:`paged_attention_decode_gathered` are the engine's CPU path: a batch-1
decode step on a small model is dispatch-bound (a few µs per PyTorch op, ~60 ops per layer in the
reference), so the per-step work (slot of every cached token, the padding mask) is done once per
step by :func:`decode_slots` and shared by all layers, and each layer's attention is then a handful
of ops (two gathers, two matmuls, a softmax, in fp32). :func:`extend_slots` +
:func:`paged_attention_extend_gathered` are the same for several new tokens per sequence over its
cached prefix (speculative decoding's verification step), with a causal mask built once per step.

Kernel: one program per (sequence, KV head). It loads the ``GROUP`` query heads that share the KV
head (GQA) once, walks the sequence's blocks, loads each K/V block once for the whole group,
dequantizes in registers when the cache is int8/fp8, and keeps an online softmax (running max, sum,
accumulator in fp32). Scores use broadcast-multiply + ``tl.sum`` rather than ``tl.dot``, so no
minimum tile size applies and decode stays memory-bound as it should.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from . import triton_support
from .triton_support import HAS_TRITON, tl, triton

__all__ = ["paged_attention_decode", "paged_attention_decode_reference", "paged_attention_decode_gathered",
           "paged_attention_extend_gathered", "decode_slots", "extend_slots", "gather_kv", "index_blocks",
           "triton_decode_available"]


_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def index_blocks(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``cache[ids]``; fp8 goes through a uint8 view (indexing kernels do not cover fp8 everywhere)."""
    if cache.dtype in _FP8:
        return cache.view(torch.uint8)[ids].view(cache.dtype)
    return cache[ids]


def gather_kv(cache: torch.Tensor, scale: Optional[torch.Tensor], block_table: torch.Tensor, length: int,
              dtype: torch.dtype) -> torch.Tensor:
    """One sequence's first ``length`` cached vectors, [length, num_kv_heads, head_dim] in ``dtype``."""
    n_blocks = (length + cache.shape[1] - 1) // cache.shape[1]
    ids = block_table[:n_blocks].long()
    x = index_blocks(cache, ids).flatten(0, 1)[:length]
    if scale is None:
        return x.to(dtype)
    s = scale[ids].flatten(0, 1)[:length]
    return (x.float() * s.unsqueeze(-1)).to(dtype)


def paged_attention_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                     k_scale: Optional[torch.Tensor] = None,
                                     v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, H, D] -> out [B, H, D] (q's dtype). Gathers K/V per block table, masks past each length."""
    B, H, D = q.shape
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    group = H // kvh
    lens = context_lens.long()
    max_len = int(lens.max()) if B else 0
    n_blocks = (max_len + block_size - 1) // block_size
    ids = block_tables[:, :n_blocks].long().clamp_min(0)  # padding entries may be -1: never unmasked

    def dense(cache, sc):
        x = index_blocks(cache, ids).flatten(1, 2)  # [B, n_blocks*bs, kvh, D]
        x = x.float()
        if sc is not None:
            x = x * sc[ids].flatten(1, 2).unsqueeze(-1).float()
        return x[:, :max_len]

    k = dense(k_cache, k_scale)
    v = dense(v_cache, v_scale)
    qf = q.float().view(B, kvh, group, D)
    scores = torch.einsum("bkgd,btkd->bkgt", qf, k) * scale
    valid = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # [B, T]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgt,btkd->bkgd", p, v)
    return out.reshape(B, H, D).to(q.dtype)


def decode_slots(block_tables: list[list[int]], context_lens: list[int], block_size: int,
                 device: torch.device) -> tuple[Union[torch.Tensor, slice], Optional[torch.Tensor]]:
    """Per decode step, for all layers: (slots, mask). slots: the cache slot of each sequence's every
    token, row by row, padding pointing at slot 0, as a [B * T] long tensor, or as a ``slice`` when
    that is one run of consecutive slots (one sequence whose blocks follow each other: a view then
    replaces two gathers per layer). mask: [B, 1, 1, T] additive fp32, -inf past a sequence's
    length, or None when all sequences have the same length T."""
    T = max(context_lens)
    flat: list[int] = []
    for table, n in zip(block_tables, context_lens):
        flat.extend(table[p // block_size] * block_size + p % block_size for p in range(n))
        flat.extend([0] * (T - n))
    if len(block_tables) == 1 and flat == list(range(flat[0], flat[0] + T)):
        return slice(flat[0], flat[0] + T), None
    slots = torch.tensor(flat, dtype=torch.long, device=device)
    if min(context_lens) == T:
        return slots, None
    lens = torch.tensor(context_lens, device=device)
    pad = torch.arange(T, device=device)[None, :] >= lens[:, None]
    mask = torch.zeros(pad.shape, dtype=torch.float32, device=device).masked_fill_(pad, float("-inf"))
    return slots, mask[:, None, None, :]


def _gather_dense(cache: torch.Tensor, scale: Optional[torch.Tensor], slots: Union[torch.Tensor, slice], B: int,
                  T: int) -> torch.Tensor:
    """The cached vectors at ``slots`` as fp32 [B, T, kvh, D] (dequantized when ``scale`` is given).
    ``index_select`` rather than advanced indexing, a view for a ``slice``: each is a few µs cheaper."""
    kvh, D = cache.shape[2], cache.shape[3]
    flat = cache.view(-1, kvh, D)
    run = isinstance(slots, slice)
    if run:
        x = flat[slots].float()
    else:
        x = (flat.view(torch.uint8).index_select(0, slots).view(cache.dtype) if cache.dtype in _FP8
             else flat.index_select(0, slots)).float()  # [B * T, kvh, D]
    if scale is not None:
        sc = scale.view(-1, kvh)
        x = x * (sc[slots] if run else sc.index_select(0, slots)).unsqueeze(-1)
    return x.view(B, T, kvh, D)


def paged_attention_decode_gathered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    slots: Union[torch.Tensor, slice], mask: Optional[torch.Tensor], scale: float,
                                    k_scale: Optional[torch.Tensor] = None,
                                    v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, H, D] -> out [B, H, D] in q's dtype, over the tokens ``slots`` (from :func:`decode_slots`).

    Computed in fp32 whatever the cache dtype (as the reference and the Triton kernel do): on CPU a
    bf16 ``bmm`` costs several times an fp32 one at these sizes, more than the casts. Quantized
    caches are dequantized after the gather; 3-D ``bmm`` for one sequence (a few µs cheaper, which
    is what a decode step of a small model is made of)."""
    B, H, D = q.shape
    kvh = k_cache.shape[2]
    T = (slots.stop - slots.start) if isinstance(slots, slice) else slots.numel() // B
    k, v = _gather_dense(k_cache, k_scale, slots, B, T), _gather_dense(v_cache, v_scale, slots, B, T)
    qf = q.float()
    G = H // kvh
    if B == 1 and mask is None:  # [kvh, G, D] @ [kvh, D, T]
        scores = torch.bmm(qf.view(kvh, G, D), k[0].permute(1, 2, 0)).mul_(scale)
        return torch.bmm(torch.softmax(scores, dim=-1), v[0].transpose(0, 1)).view(1, H, D).to(q.dtype)
    scores = torch.matmul(qf.view(B, kvh, G, D), k.permute(0, 2, 3, 1)).mul_(scale)  # [B, kvh, G, T]
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1), v.transpose(1, 2)).reshape(B, H, D).to(q.dtype)


def extend_slots(block_tables: list[list[int]], starts: list[int], query_lens: list[int], block_size: int,
                 group: int, device: torch.device) -> tuple[Union[torch.Tensor, slice], torch.Tensor]:
    """Per extend step (several new tokens per sequence over its cached prefix: speculative
    verification, a draft catching up), for all layers: (slots, mask).

    Sequence b has ``query_lens[b]`` new tokens at positions ``starts[b]`` onwards, their K/V written
    to the cache before attention, so it attends over T_b = starts[b] + query_lens[b] cached tokens.
    Queries are laid out [B, Q] with Q = max(query_lens) (rows past a sequence's count are padding).
    slots: as :func:`decode_slots` for the lengths T_b. mask: [B, 1, Q * group, T] additive fp32,
    row ``j * group + g`` (query j, head g of a KV group) open up to position starts[b] + j (causal);
    a padding row sees the whole sequence, so that no row is all -inf."""
    lens = [s + n for s, n in zip(starts, query_lens)]
    slots, _ = decode_slots(block_tables, lens, block_size, device)
    T, Q = max(lens), max(query_lens)
    last = torch.tensor([[min(s + j, s + n - 1) if j < n else s + n - 1 for j in range(Q)]
                         for s, n in zip(starts, query_lens)], device=device)  # [B, Q] last visible position
    closed = torch.arange(T, device=device)[None, None, :] > last[:, :, None]  # [B, Q, T]
    mask = torch.zeros(closed.shape, dtype=torch.float32, device=device).masked_fill_(closed, float("-inf"))
    return slots, mask.repeat_interleave(group, dim=1)[:, None]


def paged_attention_extend_gathered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    slots: Union[torch.Tensor, slice], mask: torch.Tensor, scale: float,
                                    k_scale: Optional[torch.Tensor] = None,
                                    v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, Q, H, D] (Q new tokens per sequence) -> out [B, Q, H, D] in q's dtype, over the tokens
    ``slots`` with the causal ``mask`` of :func:`extend_slots`; fp32 like the decode path. The Q
    queries of a KV group are rows of one matmul: [B, kvh, Q * G, D] @ [B, kvh, D, T]."""
    B, Q, H, D = q.shape
    kvh = k_cache.shape[2]
    G = H // kvh
    T = (slots.stop - slots.start) if isinstance(slots, slice) else slots.numel() // B
    k, v = _gather_dense(k_cache, k_scale, slots, B, T), _gather_dense(v_cache, v_scale, slots, B, T)
    qf = q.float().reshape(B, Q, kvh, G, D).permute(0, 2, 1, 3, 4).reshape(B, kvh, Q * G, D)
    scores = torch.matmul(qf, k.permute(0, 2, 3, 1)).mul_(scale).add_(mask)  # [B, kvh, Q * G, T]
    out = torch.matmul(torch.softmax(scores, dim=-1), v.transpose(1, 2))  # [B, kvh, Q * G, D]
    return out.view(B, kvh, Q, G, D).permute(0, 2, 1, 3, 4).reshape(B, Q, H, D).to(q.dtype)


if HAS_TRITON:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr, sm_scale,
        stride_qb, stride_qh,
        stride_cb, stride_ct, stride_ch,
        stride_sb, stride_st, stride_sh,
        stride_btb, stride_ob, stride_oh,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_t = tl.arange(0, BLOCK_SIZE)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_g

        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        q = q * sm_scale

        length = tl.load(lens_ptr + b)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        n_blocks = tl.cdiv(length, BLOCK_SIZE)
        for i in range(0, n_blocks):
            block = tl.load(bt_ptr + b * stride_btb + i).to(tl.int64)
            pos = i * BLOCK_SIZE + offs_t
            t_mask = pos < length
            kv_off = block * stride_cb + offs_t[:, None] * stride_ct + kvh * stride_ch + offs_d[None, :]
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            if QUANT:
                s_off = block * stride_sb + offs_t * stride_st + kvh * stride_sh
                k = k * tl.load(ks_ptr + s_off, mask=t_mask, other=0.0)[:, None]
                v = v * tl.load(vs_ptr + s_off, mask=t_mask, other=0.0)[:, None]
            # scores [BLOCK_G, BLOCK_SIZE]
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def triton_decode_available(device: torch.device) -> bool:
    """Whether :func:`paged_attention_decode` will run the Triton kernel for tensors on ``device``."""
    if not triton_support.HAS_TRITON:
        return False
    if triton_support.INTERPRET:
        return torch.device(device).type == "cpu"
    return torch.device(device).type == "cuda"


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                           use_triton: Optional[bool] = None) -> torch.Tensor:
    """q [B, H, D] -> out [B, H, D]; Triton when available for q's device (or ``use_triton``), else the reference."""
    if use_triton is None:
        use_triton = triton_decode_available(q.device)
    if not use_triton:
        return paged_attention_decode_reference(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    if not triton_support.HAS_TRITON:
        raise RuntimeError("triton is not installed")
    B, H, D = q.shape
    num_blocks, block_size, kvh, d2 = k_cache.shape
    if d2 != D or H % kvh:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two block size, got {block_size}")
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must share a layout with contiguous head_dim")
    quant = k_scale is not None
    q = q.contiguous()
    out = torch.empty_like(q)
    if B == 0:
        return out
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    ks = k_scale if quant else context_lens  # dummies, never read when QUANT is False
    vs = v_scale if quant else context_lens
    s_strides = (k_scale.stride(0), k_scale.stride(1), k_scale.stride(2)) if quant else (0, 0, 0)
    if quant and v_scale.stride() != k_scale.stride():
        raise ValueError("k_scale and v_scale must share a layout")
    group = H // kvh
    kc, vc = k_cache, v_cache
    _paged_decode_kernel[(B, kvh)](
        q, kc, vc, ks, vs, block_tables, context_lens, out, float(scale),
        q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        *s_strides,
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(_next_pow2(group), 1), BLOCK_SIZE=block_size,
        HEAD_DIM=D, BLOCK_D=_next_pow2(D), QUANT=quant,
    )
    return out
