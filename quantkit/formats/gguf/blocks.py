"""llama.cpp block layouts: one packer per ggml type, used by the GGUF writer and reader alike.

`pack(qw, type)` turns a `QuantizedWeight` on that type's grid into the bytes of its rows
(uint8 [N, K / block * nbytes]) and refuses, with one line naming what would be lost, a weight the
type cannot hold exactly; `unpack(raw, type, k)` gives the QuantizedWeight back, bit for bit.
Float types (F32/F16/BF16) go through `pack_float`/`unpack_float`.

Layouts (ggml-common.h; dequantize_row_* in ggml-quants.c), little-endian, d/m/dmin fp16:
  Q4_0  d, qs[16]              qs[j] = q[j] | q[j+16] << 4           w = d*(q-8)
  Q4_1  d, m, qs[16]                                                 w = d*q + m
  Q5_0  d, qh u32, qs[16]      bit j of qh = bit 4 of q[j]           w = d*(q-16)
  Q5_1  d, m, qh u32, qs[16]                                         w = d*q + m
  Q8_0  d, int8 qs[32]                                               w = d*q
  Q4_K  d, dmin, scales[12], qs[128]   qs[32c+l] = q[64c+l] | q[64c+32+l] << 4
  Q5_K  d, dmin, scales[12], qh[32], qs[128]   bit s of qh[l] = bit 4 of q[32s+l]
        sub-block j of 32: w = d*sc_j*q - dmin*m_j, sc/m 6-bit in scales[12] (`_pack_scales_k4`)
  Q6_K  ql[128], qh[64], int8 scales[16], d    w = d*sc_j*(q-32), sub-blocks of 16
"""
from __future__ import annotations

import sys

import numpy as np
import torch

from quantkit.errors import QuantkitError
from quantkit.formats.gguf.types import GGMLType, QK_K
from quantkit.qtensor import QuantizedWeight, TwoLevelScales


def _little_endian() -> None:
    if sys.byteorder != "little":  # fp16 fields are written as the host's bytes
        raise QuantkitError("GGUF packing needs a little-endian host")


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.uint8)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [..] holding fp16 values -> uint8 [.., 2]."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _f16_from(b: torch.Tensor) -> torch.Tensor:
    """uint8 [.., 2] -> float32 [..]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(q: torch.Tensor, half: int) -> torch.Tensor:
    """[.., 2*half] codes -> [.., half] bytes: low nibbles the first half, high nibbles the second."""
    return _u8((q[..., :half] & 15) | ((q[..., half:] & 15) << 4))


def _from_nibbles(b: torch.Tensor) -> torch.Tensor:
    return torch.cat([b & 15, b >> 4], dim=-1)


def _bits_to_bytes(bits: torch.Tensor) -> torch.Tensor:
    """[.., 8n] of 0/1 -> [.., n] bytes, bit i of byte j = bits[8j + i] (little-endian bit order)."""
    shaped = bits.reshape(*bits.shape[:-1], -1, 8).to(torch.int32)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32)
    return _u8((shaped * weights).sum(-1))


def _bytes_to_bits(b: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((b.unsqueeze(-1) >> shifts) & 1).reshape(*b.shape[:-1], -1)


# ------------------------------------------------------------------ 32-blocks: Q4_0 ... Q8_0

def _pack_block32(t: GGMLType, q: torch.Tensor, d: torch.Tensor, m) -> torch.Tensor:
    """q uint8 [R, nb, 32]; d (and m) float32 [R, nb] -> [R, nb, nbytes]."""
    parts = [_f16_bytes(d)]
    if m is not None:
        parts.append(_f16_bytes(m))
    if t.bits == 8:
        parts.append(_u8((q.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)))
    else:
        if t.bits == 5:
            parts.append(_bits_to_bytes((q >> 4) & 1))  # qh: u32, bit j = bit 4 of weight j
        parts.append(_nibbles(q, 16))
    return torch.cat(parts, dim=-1)


def _unpack_block32(t: GGMLType, b: torch.Tensor):
    d = _f16_from(b[..., 0:2])
    pos, m = 2, None
    if t.zero is None:
        m, pos = _f16_from(b[..., 2:4]), 4
    if t.bits == 8:
        q = _u8(b[..., pos:pos + 32].view(torch.int8).to(torch.int16) + 128)
    elif t.bits == 5:
        high = _bytes_to_bits(b[..., pos:pos + 4])
        q = _from_nibbles(b[..., pos + 4:pos + 20]) | (high << 4)
    else:
        q = _from_nibbles(b[..., pos:pos + 16])
    return q, d, m


# ------------------------------------------------------------------ k-quants

def _pack_scales_k4(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """8 six-bit (sc, m) pairs [R, nb, 8] -> scales[12] as get_scale_min_k4 reads them."""
    sc, m = sc.to(torch.int32), m.to(torch.int32)
    lo = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6),  # bytes 0-3: sc_j, top bits of sc_{j+4}
                    m[..., :4] | ((m[..., 4:] >> 4) << 6),  # bytes 4-7: m_j, top bits of m_{j+4}
                    (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], dim=-1)  # bytes 8-11
    return _u8(lo)


def _unpack_scales_k4(s: torch.Tensor):
    s = s.to(torch.int32)
    sc_lo, m_lo = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc_hi = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    m_hi = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([sc_lo, sc_hi], -1), torch.cat([m_lo, m_hi], -1)


def _pack_k(t: GGMLType, q: torch.Tensor, tl: TwoLevelScales, rows: int, nb: int) -> torch.Tensor:
    """q uint8 [R, nb, 256] -> [R, nb, nbytes] for Q4_K/Q5_K/Q6_K."""
    sc = tl.sc.reshape(rows, nb, -1)
    d = _f16_bytes(tl.d.reshape(rows, nb))
    if t.name == "Q6_K":
        halves = q.reshape(rows, nb, 2, 4, 32)  # [half, quarter, l]: weight 128h + 32c + l
        ql = torch.cat([_u8((halves[:, :, :, 0] & 15) | ((halves[:, :, :, 2] & 15) << 4)),
                        _u8((halves[:, :, :, 1] & 15) | ((halves[:, :, :, 3] & 15) << 4))], dim=-1)
        hi = halves.to(torch.int32) >> 4
        qh = _u8(hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6))
        scales = sc.to(torch.int8).view(torch.uint8)
        return torch.cat([ql.reshape(rows, nb, 128), qh.reshape(rows, nb, 64), scales, d], dim=-1)
    parts = [d, _f16_bytes(tl.dmin.reshape(rows, nb)), _pack_scales_k4(sc, tl.m.reshape(rows, nb, -1))]
    pairs = q.reshape(rows, nb, 4, 64)
    if t.bits == 5:  # qh[l], bit s = bit 4 of weight 32s + l
        high = ((q.reshape(rows, nb, 8, 32) >> 4) & 1).to(torch.int32)
        parts.append(_u8((high << torch.arange(8, dtype=torch.int32).view(1, 1, 8, 1)).sum(2)))
    parts.append(_nibbles(pairs, 32).reshape(rows, nb, 128))
    return torch.cat(parts, dim=-1)


def _unpack_k(t: GGMLType, b: torch.Tensor, rows: int, nb: int):
    if t.name == "Q6_K":
        ql = b[..., 0:128].reshape(rows, nb, 2, 2, 32).to(torch.int32)
        qh = b[..., 128:192].reshape(rows, nb, 2, 32).to(torch.int32)
        sc = b[..., 192:208].contiguous().view(torch.int8).to(torch.int16)
        d = _f16_from(b[..., 208:210])
        quarters = [(ql[:, :, :, 0] & 15) | (((qh >> 0) & 3) << 4), (ql[:, :, :, 1] & 15) | (((qh >> 2) & 3) << 4),
                    (ql[:, :, :, 0] >> 4) | (((qh >> 4) & 3) << 4), (ql[:, :, :, 1] >> 4) | (((qh >> 6) & 3) << 4)]
        q = _u8(torch.stack(quarters, dim=3)).reshape(rows, nb * QK_K)
        return q, TwoLevelScales(d=d, sc=sc.reshape(rows, -1), super_size=QK_K)
    d, dmin = _f16_from(b[..., 0:2]), _f16_from(b[..., 2:4])
    sc, m = _unpack_scales_k4(b[..., 4:16])
    pos = 16
    q = _from_nibbles(b[..., -128:].reshape(rows, nb, 4, 32))  # [.., pair, 64]
    q = q.reshape(rows, nb, 8, 32)
    if t.bits == 5:
        qh = b[..., pos:pos + 32].to(torch.int32).reshape(rows, nb, 1, 32)
        q = q | _u8(((qh >> torch.arange(8, dtype=torch.int32).view(1, 1, 8, 1)) & 1) << 4)
    tl = TwoLevelScales(d=d, sc=sc.to(torch.int16).reshape(rows, -1), super_size=QK_K, dmin=dmin,
                        m=m.to(torch.int16).reshape(rows, -1))
    return q.reshape(rows, nb * QK_K), tl


# ------------------------------------------------------------------ fitting a weight onto a type

def _refuse(t: GGMLType, what: str) -> None:
    raise QuantkitError(f"GGUF {t.name} cannot hold this weight exactly: {what}")


def _fp16_exact(x: torch.Tensor, t: GGMLType, what: str) -> torch.Tensor:
    x = x.float()
    if not torch.equal(x.to(torch.float16).float(), x):
        bad = int((x.to(torch.float16).float() != x).sum())
        _refuse(t, f"{bad} {what} are not float16 values")
    return x


def _check_common(qw: QuantizedWeight, t: GGMLType) -> int:
    """Shape, bits, act-order and group layout; returns the weight's group size."""
    n, k = qw.shape
    if k % t.block:
        _refuse(t, f"rows of {k} columns are not a multiple of its {t.block}-weight block")
    if qw.bits != t.bits:
        _refuse(t, f"{qw.bits}-bit codes on a {t.bits}-bit grid")
    if qw.act_order == "dynamic" and not qw.has_trivial_g_idx():
        _refuse(t, "act-order groups are not contiguous (a permuted g_idx)")
    if qw.input_quant is not None:
        _refuse(t, "activation quantization (W8A8) has no GGUF form")
    gs = k if qw.group_size == -1 else qw.group_size
    if gs % t.group:
        _refuse(t, f"group size {qw.group_size} is not a multiple of its {t.group}-column groups")
    return gs


def _per_block(x: torch.Tensor, gs: int, width: int) -> torch.Tensor:
    """[N, groups of gs] -> [N, groups of `width`] (a group's value repeated over its blocks)."""
    return x.repeat_interleave(gs // width, dim=1)


def fit_block32(qw: QuantizedWeight, t: GGMLType):
    """(q [N, K], d [N, nb], m [N, nb] or None) for a 32-block type, or a refusal naming the loss."""
    gs = _check_common(qw, t)
    d = _per_block(_fp16_exact(qw.scales, t, "scales"), gs, 32)
    zeros = _per_block(qw.zeros, gs, 32)
    if t.zero is not None:
        if qw.offsets is not None or bool((zeros != t.zero).any()):
            _refuse(t, f"its zero points are not all {t.zero} (an asymmetric grid: use {t.name[:2]}_1)")
        return qw.qweight, d, None
    if qw.offsets is not None:
        if bool((zeros != 0).any()):
            _refuse(t, "float offsets on top of non-zero integer zero points")
        return qw.qweight, d, _per_block(_fp16_exact(qw.offsets, t, "offsets"), gs, 32)
    m = -(d * zeros.float())  # s*(q - z) = s*q + m with m = -s*z, exact when m is an fp16 value
    return qw.qweight, d, _fp16_exact(m, t, "minimums (-scale * zero)")


def fit_k(qw: QuantizedWeight, t: GGMLType) -> TwoLevelScales:
    """The two-level scales of a k-quant weight, checked against the type's ranges."""
    _check_common(qw, t)
    tl = qw.two_level
    if tl is None or tl.super_size != QK_K or qw.group_size != t.group:
        _refuse(t, f"it needs fp16 d per {QK_K} columns with integer sub-scales per {t.group} (a k-quant grid "
                   "from `--format gguf`); per-group float scales are not")
    lo, hi = t.sub_range
    for name in ("sc", "m"):
        v = getattr(tl, name)
        if v is not None and (int(v.min()) < lo or int(v.max()) > hi):
            _refuse(t, f"sub-block {name} outside [{lo}, {hi}]")
    _fp16_exact(tl.d, t, "super-block scales")
    if t.zero is None:
        if tl.dmin is None or tl.m is None or bool((qw.zeros != 0).any()):
            _refuse(t, "it needs dmin and per-group mins with zero points 0")
        _fp16_exact(tl.dmin, t, "super-block mins")
    elif tl.dmin is not None or bool((qw.zeros != t.zero).any()):
        _refuse(t, f"its zero points are not all {t.zero}")
    return tl


# ------------------------------------------------------------------ entry points

def pack(qw: QuantizedWeight, t: GGMLType) -> np.ndarray:
    """The rows of `qw` in type `t`'s blocks: uint8 [N, t.row_bytes(K)]."""
    _little_endian()
    n, k = qw.shape
    nb = k // t.block
    if t.two_level:
        tl = fit_k(qw, t)
        out = _pack_k(t, qw.qweight.reshape(n, nb, t.block), tl, n, nb)
    else:
        q, d, m = fit_block32(qw, t)
        out = _pack_block32(t, q.reshape(n, nb, 32), d, m)
    return out.reshape(n, nb * t.nbytes).numpy()


def unpack(raw, t: GGMLType, k: int) -> QuantizedWeight:
    """uint8 rows [N, t.row_bytes(k)] -> the QuantizedWeight they encode (codes, scales, offsets)."""
    _little_endian()
    b = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))  # a copy: raw may view a file mapping
    if b.dim() != 2 or b.shape[1] != t.row_bytes(k) or k % t.block:
        raise QuantkitError(f"GGUF {t.name}: {list(b.shape)} bytes do not hold rows of {k} weights")
    n, nb = b.shape[0], k // t.block
    b = b.reshape(n, nb, t.nbytes)
    offsets = two_level = None
    groups = k // t.group
    if t.two_level:
        q, two_level = _unpack_k(t, b, n, nb)
        scales, offsets = two_level.scales(), two_level.offsets()
    else:
        q, d, m = _unpack_block32(t, b)
        q, scales = q.reshape(n, k), d.reshape(n, groups)
        offsets = None if m is None else m.reshape(n, groups)
    zero = 0 if t.zero is None else t.zero
    return QuantizedWeight(qweight=q.reshape(n, k), scales=scales, zeros=torch.full((n, groups), zero, dtype=torch.int32),
                           g_idx=torch.arange(k, dtype=torch.int32) // t.group, bits=t.bits, group_size=t.group,
                           sym=t.zero is not None, offsets=offsets, two_level=two_level)


FLOAT_TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def pack_float(w: torch.Tensor, t: GGMLType, exact: bool = True) -> np.ndarray:
    """A float tensor as F32/F16/BF16 bytes (uint8 [.., K * size]); with exact=True refuses values
    the type would change (a bf16 model's tiny weights in F16, say)."""
    _little_endian()
    dtype = FLOAT_TORCH[t.name]
    w = w.detach()
    cast = w.to(dtype)
    if exact and not torch.equal(cast.float(), w.float()):
        bad = int((cast.float() != w.float()).sum())
        raise QuantkitError(f"GGUF {t.name} cannot hold this tensor exactly: {bad} of {w.numel()} values would change "
                            f"(use {'BF16 or ' if w.dtype == torch.bfloat16 else ''}F32)")
    return cast.contiguous().view(torch.uint8).reshape(*w.shape[:-1], -1).numpy()


def unpack_float(raw, t: GGMLType, shape: tuple[int, ...]) -> torch.Tensor:
    b = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).reshape(-1)
    return b.view(FLOAT_TORCH[t.name]).reshape(shape)
