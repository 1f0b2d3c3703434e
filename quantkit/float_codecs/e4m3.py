"""FP8 E4M3 ("fn": no infinities, max 448) through torch.float8_e4m3fn, saturating instead of overflowing to NaN."""
from __future__ import annotations

import torch

DTYPE = torch.float8_e4m3fn
MAX = 448.0


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E4M3 value (ties to even, torch's cast), clamped to +-448 first."""
    return x.to(torch.float32).clamp(-MAX, MAX).to(DTYPE)
