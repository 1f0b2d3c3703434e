"""Compiling quantkit's small C kernels once per machine, and loading them with ctypes.

Why C and not a wheel extension: quantkit is pure Python to install; the CPU kernels are a few
hundred lines built on first use by the system C compiler into the quantkit cache, where a
machine without a compiler simply keeps PyTorch's paths (each caller says what it falls back to).
The library's name hashes its sources and flags, so an edited kernel is never served stale.
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
from typing import NamedTuple, Optional, Sequence

import torch

FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300  # a compiler that hangs must not hang the first model load (a build takes ~1 s)
OPENMP_LIBRARIES = ("libgomp", "libiomp", "libomp")  # GNU, Intel (conda builds of PyTorch), LLVM


def library_path(build_dir: Path, stem: str, sources: Sequence[Path], flags: Sequence[str] = FLAGS) -> Path:
    """Where the library built from `sources` (the first is compiled; the others are files it
    #includes) lives in `build_dir`."""
    digest = hashlib.sha256(b"".join(Path(s).read_bytes() for s in sources) + " ".join(flags).encode())
    return build_dir / f"{stem}-{digest.hexdigest()[:16]}.so"


def build(build_dir: Path, stem: str, sources: Sequence[Path], flags: Sequence[str] = FLAGS) -> Path:
    """Compile ``sources[0]`` into `build_dir` (once per content); written to a temp file and
    renamed, so a racing process or an interrupted build leaves no broken library."""
    lib = library_path(build_dir, stem, sources, flags)
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
            done = subprocess.run([compiler, *flags, str(sources[0]), "-o", part], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{Path(compiler).name} did not finish in {BUILD_TIMEOUT_S} s") from None
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        os.replace(part, lib)
    finally:
        Path(part).unlink(missing_ok=True)
    return lib


def openmp_runtimes() -> set[str]:
    """The OpenMP runtime files mapped into this process (Linux; empty elsewhere): one means a
    kernel's libgomp is PyTorch's; two (e.g. PyTorch on Intel's libiomp5) would be two thread pools."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps.splitlines()
            if line.rsplit("/", 1)[-1].startswith(OPENMP_LIBRARIES)}


class Loaded(NamedTuple):
    """A compiled library (``lib``), or why there is none (``problem``); ``threads_ok``: only one
    OpenMP runtime is mapped, so the kernel's threads are PyTorch's own pool (a second runtime would
    leave two pools spinning against each other, and then the kernels stay on one thread)."""
    lib: Optional[ctypes.CDLL]
    problem: Optional[str]
    threads_ok: bool


def load(build_dir: Path, stem: str, sources: Sequence[Path]) -> Loaded:
    """Build (once) and load the library of `sources`, where it can run: Linux on an AVX2 CPU."""
    capability = torch.backends.cpu.get_cpu_capability()
    if sys.platform != "linux" or capability not in ("AVX2", "AVX512"):
        return Loaded(None, f"needs Linux on an AVX2 CPU (this is {sys.platform}, {capability})", False)
    try:
        lib = ctypes.CDLL(str(build(build_dir, stem, sources)))
    except (OSError, RuntimeError) as e:
        return Loaded(None, f"could not build it ({str(e).splitlines()[0] if str(e) else type(e).__name__})", False)
    return Loaded(lib, None, len(openmp_runtimes()) <= 1)
