"""Faster equivalents of a family's modules for the one-pass calibration forward, each returned only
where it computes what the module does (callers still compare it with the module on real data)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.models.norms import rms_norm


def fused_rms_norm(norm: nn.Module) -> Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The norm as one fused `F.rms_norm` (plus its weight, written into `out`), for a Llama-style
    RMSNorm in fp32 (weight * x * rsqrt(mean(x^2) + eps)); None when the module does not look like
    one. The caller still checks it against the module's own forward before trusting it."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.dtype != torch.float32 \
            or not isinstance(eps, float) or getattr(norm, "bias", None) is not None:
        return None
    def run(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, eps, out=out)

    return run


def act_in_place(act: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """act(x) over x itself where the activation is SiLU (the Llama family's): no temporary."""
    if isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return F.silu(x, inplace=True)
    return act(x)
