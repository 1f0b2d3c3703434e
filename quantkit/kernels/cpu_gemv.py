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
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

SOURCE = Path(__file__).with_name("cpu_gemv.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
BLOCK = 32  # activation block, and the granularity group sizes must respect
BUILD_TIMEOUT_S = 300  # a compiler that hangs must not hang the first model load (a build takes ~1 s)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K/2] bytes: in each block of 32, byte j = code j | code (j + 16) << 4."""
    n, k = codes.shape
    blocks = codes.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


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


def _library_path(build_dir: Path) -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return build_dir / f"cpu_gemv-{key}.so"


def _build(build_dir: Path) -> Path:
    """Compile the C file into `build_dir` (once: the name hashes source and flags); written to a
    temp file and renamed, so a racing process or an interrupted build leaves no broken library."""
    lib = _library_path(build_dir)
    if lib.exists():
        return lib
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc or $CC) on PATH")
    build_dir.mkdir(parents=True, exist_ok=True)
    fd, part = tempfile.mkstemp(dir=build_dir, prefix=".tmp-", suffix=".so")
    os.close(fd)
    try:
        try:
            done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", part], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{Path(compiler).name} did not finish in {BUILD_TIMEOUT_S} s") from None
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        os.replace(part, lib)
    finally:
        Path(part).unlink(missing_ok=True)
    return lib


OPENMP_LIBRARIES = ("libgomp", "libiomp", "libomp")  # GNU, Intel (conda builds of PyTorch), LLVM


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtime files mapped into this process (Linux; empty elsewhere): one means the
    kernel's libgomp is PyTorch's; two (e.g. PyTorch on Intel's libiomp5) would be two thread pools."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps.splitlines()
            if line.rsplit("/", 1)[-1].startswith(OPENMP_LIBRARIES)}


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
        self.weight = pack_int4(codes)
        self.scale = scales.float().contiguous()
        self.zoff = (-scales.float() * zeros.float()).contiguous()
        self._fn = lib.quantkit_int4_gemm

    def _launch(self, x_ptr: int, m: int, y_ptr: int, threads: int) -> int:
        return self._fn(x_ptr, m, self.k, self.n, self.weight.data_ptr(), self.scale.data_ptr(),
                        self.zoff.data_ptr(), self.group_size, y_ptr, threads)


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


class CpuGemvKernels:
    """The compiled library, or why there is none (``problem``)."""

    def __init__(self, build_dir: Path):
        self.lib: Optional[ctypes.CDLL] = None
        self.problem: Optional[str] = None
        self.threads_ok = False
        if sys.platform != "linux" or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
            self.problem = f"needs Linux on an AVX2 CPU (this is {sys.platform}, {torch.backends.cpu.get_cpu_capability()})"
            return
        try:
            lib = ctypes.CDLL(str(_build(build_dir)))
        except (OSError, RuntimeError) as e:
            self.problem = f"could not build it ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
            return
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.quantkit_int4_gemm.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int]
        lib.quantkit_int4_gemm.restype = ctypes.c_int
        lib.quantkit_int8_gemm.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int]
        lib.quantkit_int8_gemm.restype = ctypes.c_int
        self.lib = lib
        # one OpenMP runtime means the kernel's threads are PyTorch's own pool; a second one would
        # leave two pools spinning against each other, so then the kernel stays on one thread
        self.threads_ok = len(_openmp_runtimes()) <= 1

    def prepare_int4(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> Int4Gemv:
        if self.lib is None:
            raise RuntimeError(f"the CPU gemv kernels are unavailable: {self.problem}")
        return Int4Gemv(self.lib, codes, scales, zeros, group_size, self.threads_ok)

    def prepare_int8(self, weight: torch.Tensor, scales: torch.Tensor) -> Int8Gemv:
        if self.lib is None:
            raise RuntimeError(f"the CPU gemv kernels are unavailable: {self.problem}")
        return Int8Gemv(self.lib, weight, scales, self.threads_ok)
