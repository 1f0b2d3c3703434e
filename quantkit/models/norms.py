"""The Llama family's RMSNorm as one fused call, shared by the calibration driver and the engine.

transformers writes it as seven ops (upcast, pow, mean, + eps, rsqrt, mul, cast back, then the
weight); ``F.rms_norm`` without a weight is PyTorch's composite of those very ops, one Python call
instead of seven. The weight stays outside: inside, bf16 would round once where transformers rounds
twice. Bit-equal to transformers' LlamaRMSNorm in fp32, bf16 and fp16 (tests/test_models.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, as transformers' Llama/Qwen compute it
    (written into `out` when given, e.g. a slice of a preallocated buffer)."""
    return torch.mul(weight, F.rms_norm(x, (x.shape[-1],), None, eps), out=out)
