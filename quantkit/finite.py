"""Weights must be finite before anything rounds them.

One NaN in a group makes its min/max (and so its scale) NaN or, after the grids' guards, a
placeholder: the group's other weights then round to garbage while the run exits 0. Every path
that rounds or re-packs weights (the calibration driver for every method, GGUF's own rounding,
`convert`) calls `require_finite` first, so a damaged source is refused naming the tensor.
"""
from __future__ import annotations

import torch

from quantkit.errors import QuantkitError


def require_finite(name: str, tensor: torch.Tensor, where: str = "the source model") -> None:
    """QuantkitError naming `name` (in `where`) when the floating tensor holds NaN or inf."""
    if not tensor.is_floating_point() or tensor.numel() == 0 or tensor.device.type == "meta":
        return
    lo, hi = torch.aminmax(tensor.detach().reshape(-1))
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):  # one read: NaN or inf anywhere shows in the min or max
        return
    bad = int((~torch.isfinite(tensor)).sum())
    raise QuantkitError(f"{where}: tensor {name} holds {bad} NaN/inf value(s) of {tensor.numel()}; the model is "
                        "damaged: re-download or repair it (quantkit does not round non-finite weights)")
