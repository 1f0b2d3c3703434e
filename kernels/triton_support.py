"""The one place quantkit.kernels imports Triton, and says whether its kernels run for a tensor.

triton ships Linux wheels only and is an optional dependency elsewhere: without it the kernel
modules still import (their ``@triton.jit`` bodies are skipped under ``if HAS_TRITON``) and every
public function falls back to its plain-PyTorch reference. Tests may set ``HAS_TRITON`` here to
False to take that path on a machine that has triton.
"""
from __future__ import annotations

import os
from typing import Optional

try:
    import triton
    import triton.language as tl
except ImportError:  # not installed (macOS, Windows, a Linux without the wheel)
    triton = None
    tl = None

HAS_TRITON = triton is not None

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when the kernel modules are imported.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")

# The GEMM kernels autotune on GPU: each new (M bucket, N, K) key compiles and times every candidate
# config, seconds per key. QUANTKIT_TRITON_AUTOTUNE=0 takes one fixed config instead (the GPU tests,
# or a quick start); the interpreter always does (its timings would mean nothing).
AUTOTUNE = not INTERPRET and os.environ.get("QUANTKIT_TRITON_AUTOTUNE", "1").strip().lower() not in ("0", "false", "no", "off")


def fixed_config(interpreter: dict, gpu: dict) -> Optional[dict]:
    """The config a GEMM launches with instead of autotuning: `interpreter` under the interpreter,
    `gpu` on a GPU with autotuning switched off, None (autotune) otherwise."""
    if INTERPRET:
        return interpreter
    return None if AUTOTUNE else gpu


def triton_installed() -> bool:
    """True when the triton package imported (it ships Linux wheels only; optional elsewhere)."""
    return HAS_TRITON


def triton_available() -> bool:
    """True when the Triton kernels will actually run: triton imported and either a CUDA device is
    present or ``TRITON_INTERPRET=1`` was set when the kernel modules were imported (triton reads it
    when kernels are decorated, so setting it later has no effect). Otherwise callers get the references."""
    if not HAS_TRITON:
        return False
    if INTERPRET:
        return True
    import torch

    return bool(torch.cuda.is_available())


def runs_for(t) -> bool:
    """Whether a Triton kernel runs on tensor `t`: triton present and `t` on CUDA (or the interpreter on)."""
    return HAS_TRITON and (INTERPRET or t.is_cuda)
