"""quantkit.kernels: Triton GEMMs for quantized weights, with plain-PyTorch references.

Importing this package never needs a GPU and never fails when triton is missing: the public
functions then fall back to the references in :mod:`.reference` (which are also the test oracle).

* :func:`dequant_gemm` - W4A16 / W8A16 on GPTQ v1 packed weights (split-K for M <= 16, tiled
  ``tl.dot`` above), :func:`prepare_act_order` for act-order checkpoints (do it once at load).
* :func:`per_token_quant_int8`, :func:`int8_gemm`, :func:`w8a8_linear` - W8A8 (``w_q`` is [N, K]).
* :func:`triton_available` - whether the Triton paths will actually run; :func:`triton_installed` -
  whether the optional triton package is there at all (see :mod:`.triton_support`).

Set ``TRITON_INTERPRET=1`` before importing to run the kernels on CPU tensors (slow; tests only).
"""
from __future__ import annotations

from .reference import (
    dequantize_gptq,
    pack_gptq_qweight,
    pack_gptq_qzeros,
    quantize_per_token_int8,
    unpack_gptq_qweight,
    unpack_gptq_qzeros,
    w4a16_reference,
    w8a8_reference,
)
from . import triton_support
from .dequant_gemm import dequant_gemm, prepare_act_order
from .int8_gemm import int8_gemm, per_token_quant_int8, w8a8_linear

__all__ = [
    "dequant_gemm",
    "prepare_act_order",
    "int8_gemm",
    "per_token_quant_int8",
    "w8a8_linear",
    "triton_available",
    "triton_installed",
    "unpack_gptq_qweight",
    "unpack_gptq_qzeros",
    "pack_gptq_qweight",
    "pack_gptq_qzeros",
    "dequantize_gptq",
    "w4a16_reference",
    "w8a8_reference",
    "quantize_per_token_int8",
]


def triton_installed() -> bool:
    """True when the triton package imported (it ships Linux wheels only; optional elsewhere)."""
    return triton_support.HAS_TRITON


def triton_available() -> bool:
    """True when the Triton kernels will actually run: triton imported and either a CUDA device is
    present or ``TRITON_INTERPRET=1`` was set when this package was imported (triton reads it when
    kernels are decorated, so setting it later has no effect). Otherwise callers get the references."""
    if not triton_support.HAS_TRITON:
        return False
    if triton_support.INTERPRET:
        return True
    import torch

    return bool(torch.cuda.is_available())
