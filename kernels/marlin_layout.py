"""Marlin's pre-shuffled int4 weight layout (W4A16), its inverse, and a plain-PyTorch GEMM on it.

A GPTQ-packed weight (``qweight [K/8, N]``, eight 4-bit codes per int32 along K) is read by a
decode GEMV as strided columns; a tensor-core kernel wants each warp to fetch, with one 128-bit
load per thread, exactly the codes its ``mma.sync.m16n8k16`` B fragments need. Marlin (Frantar et
al., 2024; vLLM's ``gptq_marlin_repack``) shuffles the weight once at load so that this holds; this
module is that shuffle, written from Marlin's reference packer (``marlin/__init__.py``,
``_get_perms`` and ``Layer.pack``), checked here against the PTX fragment layout and against the
plain dequantized matmul (tests/test_marlin_layout.py). The kernel that consumes it is not written
yet (issue #49: it needs a GPU to develop and test).

Layout of ``qweight`` ([K/16, 2N] int32), for codes ``W[k, n]`` (K % 16 == 0, N % 64 == 0):

1. Tiles of 16 x 16 (k x n): row ``kt`` of the result holds the tiles ``W[16 kt : 16 kt + 16, :]``
   one after another along N, each tile's 256 codes row-major (k major).
2. Each run of 1024 codes (four such tiles: a 16 x 64 tile, what one warp multiplies) is permuted by
   :func:`marlin_permutations`' ``perm``: thread t of the warp (t = 0..31) gets the 32 codes at
   positions 32 t .. 32 t + 31, eight for each of the four 16 x 16 tiles j, namely the B fragments of
   ``mma.m16n8k16``: rows k = 2 (t % 4) + {0, 1} and 2 (t % 4) + 8 + {0, 1}, columns n = 16 j + t // 4
   (the first n8 half) and 16 j + 8 + t // 4 (the second).
3. Eight consecutive codes go into one int32, code i at bits 4 i, after the interleave
   ``[0, 2, 4, 6, 1, 3, 5, 7]``: nibbles i and i + 4 then hold a fragment's register pair (rows k and
   k + 1), which Marlin's dequantization turns into two fp16 values with one ``lop3`` and one
   ``sub`` / ``fma``.

So thread t's four words are consecutive (one 128-bit load) and a warp's 32 loads are 512 contiguous
bytes (coalesced). ``scales`` stay [G, N] with each run of 64 columns permuted by ``scale_perm``
(grouped) or each run of 32 by ``scale_perm_single`` (one group over all of K), the order in which
the kernel's threads read them. Asymmetric weights keep their true zero points [G, N] (not GPTQ's
zero - 1) permuted like the scales, interleaved and packed eight per int32 along N, as vLLM's
``marlin_zero_points`` does; symmetric weights have none (zero 8). Act-order checkpoints are
sorted first (``dequant_gemm.prepare_act_order``): the layout assumes contiguous groups.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .reference import pack_gptq_qweight, pack_gptq_qzeros, unpack_gptq_qweight, unpack_gptq_qzeros

TILE = 16  # the tensor-core tile along k and n
WARP_TILE_N = 64  # n columns of one warp's 16 x 64 tile (1024 codes)
PACK = 8  # 4-bit codes per int32
INTERLEAVE = (0, 2, 4, 6, 1, 3, 5, 7)


@functools.lru_cache(maxsize=None)
def marlin_permutations() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(perm [1024], scale_perm [64], scale_perm_single [32]) as in Marlin's ``_get_perms``:
    ``perm[p]`` is the position, in a 16 x 64 tile laid out as four row-major 16 x 16 tiles, of the
    code stored at position p (the interleave of step 3 included)."""
    perm: list[int] = []
    for thread in range(32):
        fragment = []
        col = thread // 4
        for half in (0, 1):  # the two n8 halves of a 16 x 16 tile
            for row in (2 * (thread % 4), 2 * (thread % 4) + 1, 2 * (thread % 4 + 4), 2 * (thread % 4 + 4) + 1):
                fragment.append(16 * row + col + 8 * half)
        for tile in range(4):
            perm.extend(p + 256 * tile for p in fragment)
    perm_t = torch.tensor(perm).view(-1, PACK)[:, list(INTERLEAVE)].reshape(-1)
    scale_perm = torch.tensor([i + 8 * j for i in range(8) for j in range(8)])
    scale_perm_single = torch.tensor([2 * i + j for i in range(4) for j in (0, 1, 8, 9)])
    return perm_t, scale_perm, scale_perm_single


@dataclass
class MarlinWeight:
    """An int4 weight in Marlin's layout (see the module docstring); ``k``, ``n``, ``group_size`` its shape."""
    qweight: torch.Tensor  # [K/16, 2N] int32
    scales: torch.Tensor  # [G, N], columns permuted
    qzeros: Optional[torch.Tensor]  # [G, N/8] int32 true zeros, permuted and interleaved; None: symmetric
    k: int
    n: int
    group_size: int


def _check_shape(k: int, n: int, group_size: int) -> None:
    if k % TILE or n % WARP_TILE_N:
        raise ValueError(f"Marlin's layout needs K % {TILE} == 0 and N % {WARP_TILE_N} == 0, got K={k}, N={n}")
    if k % group_size:
        raise ValueError(f"K={k} must be a multiple of group_size={group_size}")


def _scale_order(groups: int) -> torch.Tensor:
    _, scale_perm, scale_perm_single = marlin_permutations()
    return scale_perm if groups > 1 else scale_perm_single


def _permute_columns(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Each run of len(order) columns of t [G, N] reordered: out[:, r + i] = t[:, r + order[i]]."""
    return t.reshape(-1, order.numel())[:, order.to(t.device)].reshape(t.shape)


def _unpermute_columns(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    inverse = torch.argsort(order)
    return t.reshape(-1, order.numel())[:, inverse.to(t.device)].reshape(t.shape)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] codes 0..15 -> [R, C/8] int32, code i of each eight at bits 4 i."""
    c = codes.to(torch.int64).reshape(codes.shape[0], -1, PACK)
    shifts = torch.arange(0, 4 * PACK, 4, device=codes.device)
    words = (c << shifts).sum(dim=-1)  # < 2**32: the nibbles do not overlap
    return (words - ((words >= 2 ** 31).to(torch.int64) << 32)).to(torch.int32)


def _unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 4 * PACK, 4, device=words.device, dtype=torch.int32)
    return ((words[:, :, None] >> shifts) & 0xF).reshape(words.shape[0], -1)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, PACK)[:, list(INTERLEAVE)].reshape(t.shape)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    inverse = [INTERLEAVE.index(i) for i in range(PACK)]
    return t.reshape(-1, PACK)[:, inverse].reshape(t.shape)


def shuffle_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``W [K, N]`` (0..15) -> Marlin's packed ``qweight [K/16, 2N]`` (steps 1-3)."""
    k, n = codes.shape
    perm, _, _ = marlin_permutations()
    tiles = codes.reshape(k // TILE, TILE, n // TILE, TILE).permute(0, 2, 1, 3).reshape(k // TILE, n * TILE)
    shuffled = tiles.reshape(-1, perm.numel())[:, perm.to(codes.device)].reshape(tiles.shape)
    return _pack_nibbles(shuffled)


def unshuffle_codes(qweight: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """The inverse of :func:`shuffle_codes`: ``qweight [K/16, 2N]`` -> codes ``[K, N]`` int32."""
    perm, _, _ = marlin_permutations()
    shuffled = _unpack_nibbles(qweight)
    tiles = torch.empty_like(shuffled)
    tiles.view(-1, perm.numel())[:, perm.to(qweight.device)] = shuffled.reshape(-1, perm.numel())
    return tiles.reshape(k // TILE, n // TILE, TILE, TILE).permute(0, 2, 1, 3).reshape(k, n)


def shuffle(qweight: torch.Tensor, scales: torch.Tensor, qzeros: Optional[torch.Tensor],
            group_size: Optional[int]) -> MarlinWeight:
    """A 4-bit GPTQ v1 weight (``qweight [K/8, N]``, ``scales [G, N]``, packed ``qzeros [G, N/8]``
    storing zero - 1, or None for symmetric) in Marlin's layout; done once, at load."""
    codes = unpack_gptq_qweight(qweight, 4)
    k, n = codes.shape
    gs = k if group_size is None or group_size <= 0 else int(group_size)
    _check_shape(k, n, gs)
    groups = k // gs
    if tuple(scales.shape) != (groups, n):
        raise ValueError(f"scales must be [{groups}, {n}] for K={k}, group_size={gs}; got {tuple(scales.shape)}")
    order = _scale_order(groups)
    zeros = None
    if qzeros is not None:
        true_zeros = unpack_gptq_qzeros(qzeros, 4, n)
        zeros = _pack_nibbles(_interleave(_permute_columns(true_zeros, order)))
    return MarlinWeight(shuffle_codes(codes), _permute_columns(scales, order).contiguous(), zeros, k, n, gs)


def unshuffle(w: MarlinWeight) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The GPTQ v1 ``(qweight, scales, qzeros)`` a :class:`MarlinWeight` was made from, exactly."""
    order = _scale_order(w.k // w.group_size)
    qzeros = None
    if w.qzeros is not None:
        true_zeros = _unpermute_columns(_deinterleave(_unpack_nibbles(w.qzeros)), order)
        qzeros = pack_gptq_qzeros(true_zeros, 4)
    return (pack_gptq_qweight(unshuffle_codes(w.qweight, w.k, w.n), 4),
            _unpermute_columns(w.scales, order).contiguous(), qzeros)


def marlin_dequantize(w: MarlinWeight) -> torch.Tensor:
    """Dense fp32 ``W [K, N]`` from the shuffled layout: ``scales[g, n] * (code[k, n] - zero[g, n])``,
    ``g = k // group_size``, zero 8 when symmetric."""
    order = _scale_order(w.k // w.group_size)
    codes = unshuffle_codes(w.qweight, w.k, w.n)
    scales = _unpermute_columns(w.scales, order).float()
    if w.qzeros is None:
        zeros = torch.full_like(scales, 8.0)
    else:
        zeros = _unpermute_columns(_deinterleave(_unpack_nibbles(w.qzeros)), order).float()
    g = torch.arange(w.k, device=codes.device) // w.group_size
    return scales[g] * (codes.float() - zeros[g])


def marlin_gemm_reference(x: torch.Tensor, w: MarlinWeight) -> torch.Tensor:
    """``x [..., K] @ W`` on the shuffled layout, fp32 math, output in x's dtype: the reference a
    Marlin-class kernel must reproduce (as ``reference.w4a16_reference`` is for the GPTQ layout)."""
    if x.shape[-1] != w.k:
        raise ValueError(f"x has K={x.shape[-1]} but the weight has K={w.k}")
    return (x.float() @ marlin_dequantize(w)).to(x.dtype)
