"""CPU kernels for 4-bit and 8-bit weights at decode sizes (a few rows), and their plain PyTorch references.

Why: PyTorch's packed int4 CPU kernel (``_weight_int4pack_mm_for_cpu``) multiplies one row by a
576 x 3072 weight at ~6 GMAC/s per core on an AVX2 machine, so a batch-1 decode step of the demo
model spends more time in its 120 projections than llama.cpp spends on the whole step. llama.cpp's
trick is to quantize the activations too (int8 in blocks of 32) and do the dot products in integer
SIMD; ``cpu_gemv.c`` does the same on quantkit's own 4-bit layout (any group size that is a
multiple of 32, asymmetric or symmetric) and on symmetric per-row int8 weights (PyTorch's
``_weight_int8pack_mm`` is as slow at one row; scripts/bench_cpu_gemv.py compares both). It changes the arithmetic the way
llama.cpp's does: :func:`reference_int4_gemv` and :func:`reference_int8_gemv` say exactly what it computes.

The C file is compiled once per machine with the system C compiler (``gcc -O3 -mavx2 -mfma
-fopenmp``) into a cache folder and loaded with ctypes; where there is no compiler, no AVX2, or the
build fails, ``CpuGemvKernels.problem`` says why and the caller keeps PyTorch's kernels.

The same library has an fp32 x fp32 kernel (:class:`F32Gemv`, ``prepare_f32``) for an unquantized
model's few-row products (speculative verification): the exact fp32 product, batch invariant.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from quantkit.kernels import c_library

SOURCE = Path(__file__).with_name("cpu_gemv.c")
BLOCK = 32  # activation block, and the granularity group sizes must respect


TILE_ROWS = 8  # output rows the kernel takes at once (lane r of a vector = row r of the tile)


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """4-bit codes [N, K] (0..15) with per-group scales and zero points [N, K/G] -> cpu_gemv.c's weight
    stream, bytes [ceil(N/8), K/G, 64 + (G/32) * 128]: per tile of 8 rows (N padded with zero rows) and
    group, the rows' scales and zero offsets -scale * zero (8 + 8 fp32), then per block b of 32 inputs
    and vector L the bytes (r, i) = code[r, 32b + 4L + i] | code[r, 32b + 16 + 4L + i] << 4."""
    n, k = codes.shape
    if codes.numel() and not (0 <= int(codes.min()) and int(codes.max()) <= 15):
        raise ValueError("4-bit codes must lie in 0..15 (the kernel's exact int16 block sums rely on it)")
    groups, blocks = k // group_size, group_size // BLOCK
    rows = -(-n // TILE_ROWS) * TILE_ROWS
    c = torch.zeros(rows, k, dtype=torch.uint8)
    c[:n] = codes.to(torch.uint8)
    c = c.reshape(rows // TILE_ROWS, TILE_ROWS, groups, blocks, 2, 4, 4)  # [tile, r, g, block, half, L, i]
    nibbles = (c[:, :, :, :, 0] | (c[:, :, :, :, 1] << 4)).permute(0, 2, 3, 4, 1, 5)  # [tile, g, block, L, r, i]
    sz = torch.zeros(rows, groups, 2, dtype=torch.float32)
    sz[:n, :, 0] = scales.float()
    sz[:n, :, 1] = -scales.float() * zeros.float()
    sz = sz.reshape(rows // TILE_ROWS, TILE_ROWS, groups, 2).permute(0, 2, 3, 1)  # [tile, g, scale|zoff, r]
    head = sz.contiguous().view(torch.uint8).reshape(rows // TILE_ROWS, groups, 2 * TILE_ROWS * 4)
    body = nibbles.reshape(rows // TILE_ROWS, groups, blocks * 4 * TILE_ROWS * 4)
    return torch.cat([head, body], dim=-1).contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (int8-valued codes as fp32 [M, K/32, 32], block scales [M, K/32, 1]): d = max|x| / 127
    per block of 32, codes = round-half-even(x * (1/d)), 0 for an all-zero block."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(xb * inv), d


def reference_int4_gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        group_size: int) -> torch.Tensor:
    """What the C kernel computes, in plain PyTorch (fp64 sums): x quantized per block of 32 and
    dequantized (``d * xq``), times ``w = scales * (codes - zeros)`` (per group of `group_size` inputs)."""
    m, k = x.shape
    xq, d = quantize_activations(x)
    x_dequant = (xq * d).reshape(m, k).double()
    w = (codes.double() - zeros.double().repeat_interleave(group_size, dim=1)) \
        * scales.double().repeat_interleave(group_size, dim=1)
    return (x_dequant @ w.t()).float()


def reference_int8_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The int8 kernel in plain PyTorch (fp64 sums): x quantized per block of 32 and dequantized,
    times ``w = scales[:, None] * weight`` (int8 weight, one scale per output row)."""
    m, k = x.shape
    xq, d = quantize_activations(x)
    w = weight.double() * scales.double().reshape(-1, 1)
    return ((xq * d).reshape(m, k).double() @ w.t()).float()


class _Gemv:
    """The call path both weight types share: ``gemv(x [M, K]) -> [M, N] fp32``; a subclass holds
    its weight and says which entry point takes which tensors (``_launch``)."""

    n: int
    what: str

    def __init__(self, threads_ok: bool):
        self._threads_ok = threads_ok

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32)
        threads = torch.get_num_threads() if self._threads_ok else 1
        if self._launch(x.data_ptr(), m, y.data_ptr(), threads) != 0:
            raise MemoryError(f"{self.what} CPU kernel: scratch allocation failed")
        return y

    def _launch(self, x_ptr: int, m: int, y_ptr: int, threads: int) -> int:
        raise NotImplementedError


class Int4Gemv(_Gemv):
    """One 4-bit weight packed for the C kernel."""
    what = "int4"

    def __init__(self, lib: ctypes.CDLL, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, threads_ok: bool):
        super().__init__(threads_ok)
        n, k = codes.shape
        if k % group_size or group_size % BLOCK:
            raise ValueError(f"needs a group size that is a multiple of {BLOCK} and divides {k}, not {group_size}")
        self.n, self.k, self.group_size = n, k, group_size
        self.weight = pack_int4(codes, scales, zeros, group_size)
        self._fn = lib.quantkit_int4_gemm

    def _launch(self, x_ptr: int, m: int, y_ptr: int, threads: int) -> int:
        return self._fn(x_ptr, m, self.k, self.n, self.weight.data_ptr(), self.group_size, y_ptr, threads)


class Int8Gemv(_Gemv):
    """One int8 weight (symmetric, one scale per output row) for the C kernel."""
    what = "int8"

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, scales: torch.Tensor, threads_ok: bool):
        super().__init__(threads_ok)
        n, k = weight.shape
        if weight.dtype != torch.int8 or k % BLOCK:
            raise ValueError(f"needs an int8 weight with in_features a multiple of {BLOCK}, not {weight.dtype} x {k}")
        self.n, self.k = n, k
        self.weight = weight.contiguous()
        self.scale = scales.float().reshape(n).contiguous()
        self._fn = lib.quantkit_int8_gemm

    def _launch(self, x_ptr: int, m: int, y_ptr: int, threads: int) -> int:
        return self._fn(x_ptr, m, self.k, self.n, self.weight.data_ptr(), self.scale.data_ptr(), y_ptr, threads)


class F32Gemv(_Gemv):
    """One unquantized fp32 weight [N, K] (and optional bias [N]) for the C kernel: the exact fp32
    product, no activation quantization; its plain PyTorch reference is ``F.linear`` in fp64 (the
    tests hold the two together within the fp32 summation bound). An fp32 contiguous weight is used in
    place, not copied.

    Why: on an AVX2 CPU, fp32 ``F.linear`` of 2-5 rows is one MKL matrix-vector product per row, so
    speculative verification (k + 1 rows in one forward) reads each weight k + 1 times: on 2 cores
    (AMD EPYC Zen 3), 576 x 3072 took 0.16 ms for 1 row and 0.50 ms for 3, the 576 x 49152 LM head
    8.7-9.6 ms and 29-31 ms, so a verification cost 1.7-2.7x a decode step. The kernel streams the
    weight once for up to 16 rows, the output rows split over the threads. With the weights coming
    from memory, as they do in a decode step (``--cold``): 1 row 1.7-2.4x faster than ``F.linear``
    (1.2x than ``engine.sliced_linear.linear_fn``, what the engine calls today), 4 rows 1.25-1.5x
    its own 1 row and 9 rows 1.3-2x (the LM head: 3.6 ms for 1 row, 5.3 for 4, 5.6 for 9, where
    ``F.linear`` takes 8.5, 21 and 24). With a weight small enough to stay in L3 between calls
    (576 x 3072 is 7 MB) more rows become FMA-bound: 4 rows 1.1-1.7x, 9 rows 2.2-4x the 1-row time,
    still 1.8-6x faster than ``F.linear``. scripts/bench_cpu_gemv.py ``--kinds fp32 [--cold]``.
    Each output is one dot product in a fixed order (8-lane FMA over K, a fixed horizontal sum, then
    the bias), so a row's result is bit for bit the same whatever the other rows and however many,
    and whatever the thread count; it is not bit-equal to ``F.linear`` (MKL sums in another order).
    """
    what = "fp32"

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, bias: Optional[torch.Tensor], threads_ok: bool):
        super().__init__(threads_ok)
        if weight.dim() != 2:
            raise ValueError(f"needs a 2-d weight [out, in], not {tuple(weight.shape)}")
        n, k = weight.shape
        if bias is not None and bias.numel() != n:
            raise ValueError(f"bias has {bias.numel()} elements for {n} outputs")
        self.n, self.k = n, k
        self.weight = weight.detach().float().contiguous()
        self.bias = None if bias is None else bias.detach().float().reshape(n).contiguous()
        self._fn = lib.quantkit_f32_gemm

    def _launch(self, x_ptr: int, m: int, y_ptr: int, threads: int) -> int:
        return self._fn(x_ptr, m, self.k, self.n, self.weight.data_ptr(),
                        None if self.bias is None else self.bias.data_ptr(), y_ptr, threads)


class CpuGemvKernels:
    """The compiled library, or why there is none (``problem``)."""

    def __init__(self, build_dir: Path):
        lib, self.problem, self.threads_ok = c_library.load(build_dir, "cpu_gemv", (SOURCE,))
        self.lib: Optional[ctypes.CDLL] = lib
        if lib is None:
            return
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.quantkit_int4_gemm.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ctypes.c_int]
        lib.quantkit_int4_gemm.restype = ctypes.c_int
        lib.quantkit_int8_gemm.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int]
        lib.quantkit_int8_gemm.restype = ctypes.c_int
        lib.quantkit_f32_gemm.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int]
        lib.quantkit_f32_gemm.restype = ctypes.c_int

    def prepare_int4(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> Int4Gemv:
        if self.lib is None:
            raise RuntimeError(f"the CPU gemv kernels are unavailable: {self.problem}")
        return Int4Gemv(self.lib, codes, scales, zeros, group_size, self.threads_ok)

    def prepare_int8(self, weight: torch.Tensor, scales: torch.Tensor) -> Int8Gemv:
        if self.lib is None:
            raise RuntimeError(f"the CPU gemv kernels are unavailable: {self.problem}")
        return Int8Gemv(self.lib, weight, scales, self.threads_ok)

    def prepare_f32(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> F32Gemv:
        if self.lib is None:
            raise RuntimeError(f"the CPU gemv kernels are unavailable: {self.problem}")
        return F32Gemv(self.lib, weight, bias, self.threads_ok)
