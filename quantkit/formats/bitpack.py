"""Dense LSB-first bit packing of unsigned codes into int32 words, the one packer every layout uses.

Value i of a packed line starts at global bit i*bits (word i*bits // 32, bit i*bits % 32), so for
bits that divide 32 this is the plain "value j of a word at bits b*j" layout, and for 3-bit a value
may straddle two words: 32 values fill exactly 3 words. That is both GPTQ's 3-bit layout
(AutoGPTQ's hand-unrolled pack: values 0-9 in word 0, value 10 split 2+1 bits, ...) and
compressed-tensors' `pack_to_int32` for every width (it packs ceil(L*bits/32) words, zero padded).
Layouts differ only in which dim is packed and how values are ordered or offset before packing.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_MASK32 = 0xFFFFFFFF


def packed_length(length: int, bits: int) -> int:
    """Words needed for `length` values of `bits` bits."""
    return math.ceil(length * bits / 32)


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bit packing supports 1..8 bits, got {bits}")


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement)."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack integer `values` in [0, 2**bits) along `dim` into int32 words (ceil(L*bits/32) of them)."""
    _check_bits(bits)
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise ValueError(f"pack expects integer codes, got {values.dtype}")
    v = values.movedim(dim, -1)
    if v.numel():
        lo, hi = torch.aminmax(v)
        if int(lo) < 0 or int(hi) >= (1 << bits):
            raise ValueError(f"codes outside [0, {1 << bits}) cannot be packed in {bits} bits")
    lead, length = v.shape[:-1], v.shape[-1]
    n_words = packed_length(length, bits)
    if 32 % bits == 0:  # values never straddle words: OR the shifted values of each word in int32
        per_word = 32 // bits
        v = v.reshape(-1, length).to(torch.int32)
        rows = v.shape[0]
        if n_words * per_word != length:
            v = F.pad(v, (0, n_words * per_word - length))
        v = v.reshape(rows, n_words, per_word)
        words = v[..., 0].clone()
        for j in range(1, per_word):  # int32 shifts wrap into the sign bit: the word's two's complement
            words |= v[..., j] << (j * bits)
        return words.reshape(*lead, n_words).movedim(-1, dim).contiguous()
    v = v.to(torch.int64).reshape(-1, length)
    rows = v.shape[0]
    # chunks of 32 values fill exactly `bits` words; carry the overflow into the next word
    chunks = math.ceil(length / 32)
    v = F.pad(v, (0, chunks * 32 - length)).reshape(rows, chunks, 32)
    out = torch.zeros(rows, chunks, bits + 1, dtype=torch.int64, device=v.device)
    for i in range(32):
        word, shift = divmod(i * bits, 32)
        shifted = v[..., i] << shift
        out[..., word] |= shifted & _MASK32
        out[..., word + 1] |= shifted >> 32
    words = out[..., :bits].reshape(rows, chunks * bits)[:, :n_words]
    return _to_int32(words).reshape(*lead, n_words).movedim(-1, dim).contiguous()


def unpack(words: torch.Tensor, bits: int, length: int, dim: int) -> torch.Tensor:
    """Inverse of `pack`: `length` uint8 codes per line along `dim`."""
    _check_bits(bits)
    if words.dtype != torch.int32:
        raise ValueError(f"unpack expects int32 words, got {words.dtype}")
    n_words = packed_length(length, bits)
    w = words.movedim(dim, -1)
    if w.shape[-1] != n_words:
        raise ValueError(f"{length} values of {bits} bits need {n_words} words, got {w.shape[-1]}")
    lead = w.shape[:-1]
    w = w.reshape(-1, n_words).to(torch.int64) & _MASK32
    rows = w.shape[0]
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        per_word = 32 // bits
        shifts = torch.arange(per_word, dtype=torch.int64, device=w.device) * bits
        vals = ((w.unsqueeze(-1) >> shifts) & mask).reshape(rows, n_words * per_word)
    else:
        chunks = math.ceil(length / 32)
        w = F.pad(w, (0, chunks * bits - n_words)).reshape(rows, chunks, bits)
        w = F.pad(w, (0, 1))  # a zero word so the last value's overflow read stays in bounds
        vals = torch.empty(rows, chunks, 32, dtype=torch.int64, device=w.device)
        for i in range(32):
            word, shift = divmod(i * bits, 32)
            vals[..., i] = ((w[..., word] >> shift) | (w[..., word + 1] << (32 - shift))) & mask
        vals = vals.reshape(rows, chunks * 32)
    return vals[:, :length].to(torch.uint8).reshape(*lead, length).movedim(-1, dim).contiguous()
