"""Fold a per-input-channel scale from a group of linears into the module that feeds them.

For an ``InputGroup`` with input ``x = prev(...)`` and linears ``W_i x``, and positive scales ``s``:

    W_i x == (W_i diag(s)) (diag(1/s) x)

so dividing prev's output channels by ``s`` and multiplying each linear's weight columns by ``s``
leaves the full-precision model unchanged, while the linears now see a smoother input (SmoothQuant)
or have their salient columns enlarged before quantization (AWQ).

- norm prev: ``weight /= s`` and ``bias /= s`` (LayerNorm's output is ``n(x) * w + b``).
- linear prev: its output rows ``/= s`` (weight rows and bias). For a fused prev only the rows
  named by ``InputGroup.prev_rows`` (the v rows of qkv_proj, the up half of gate_up_proj). Under
  grouped-query attention (``InputGroup.kv_heads``) one v row feeds several o columns, whose
  scales must be equal: the row is divided by that one scale.
- followers (a MoE router, a shared-expert gate): their weight columns ``*= s`` like the linears',
  so they compute what they did on the unscaled input.

The arithmetic runs in at least float32 and is rounded once to the parameter's dtype.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from quantkit.models.base import NORM, InputGroup, resolve


@torch.no_grad()
def fold_scales(layer: nn.Module, group: InputGroup, scales: torch.Tensor) -> None:
    """Move ``scales`` (one per input channel of ``group.linears``) into ``group.prev``, in place."""
    linears = [resolve(layer, name) for name in group.linears]
    prev = resolve(layer, group.prev)
    s = scales.detach().reshape(-1)
    n = s.numel()
    for name, lin in zip(group.linears, linears):
        if not isinstance(lin, nn.Linear) or lin.in_features != n:
            raise ValueError(f"{group.linears}: '{name}' is not an nn.Linear with {n} input features")
    followers = [getattr(resolve(layer, name), "weight", None) for name in group.followers]
    for name, w in zip(group.followers, followers):
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != n:
            raise ValueError(f"follower '{name}' has no weight [*, {n}] to take the scale")
    if not torch.isfinite(s).all() or (s <= 0).any():
        raise ValueError("fold_scales needs finite, positive scales")

    if group.kind == NORM:
        weight = getattr(prev, "weight", None)
        if weight is None or weight.shape != (n,):
            raise ValueError(f"'{group.prev}' has no per-channel weight of size {n} to fold a scale into")
        _div_rows(weight, s)
        if getattr(prev, "bias", None) is not None:
            _div_rows(prev.bias, s)
    else:
        if not isinstance(prev, nn.Linear):
            raise ValueError(f"'{group.prev}' is not an nn.Linear")
        start, stop = group.prev_rows if group.prev_rows is not None else (0, prev.out_features)
        row_s = group.prev_scales(s)
        if stop - start != row_s.numel() or stop > prev.out_features:
            raise ValueError(
                f"'{group.prev}' rows {start}:{stop} (of {prev.out_features}) do not match the {n} inputs "
                f"of {group.linears}"
            )
        _div_rows(prev.weight[start:stop], row_s)
        if prev.bias is not None:
            _div_rows(prev.bias[start:stop], row_s)

    for w in [lin.weight for lin in linears] + followers:
        ct = _compute_dtype(w)
        w.copy_((w.to(ct) * s.to(device=w.device, dtype=ct)).to(w.dtype))


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _div_rows(t: torch.Tensor, s: torch.Tensor) -> None:
    """``t[i, ...] /= s[i]`` in place (``t`` may be a view of a parameter)."""
    ct = _compute_dtype(t)
    s = s.to(device=t.device, dtype=ct).reshape(-1, *([1] * (t.dim() - 1)))
    t.copy_((t.to(ct) / s).to(t.dtype))
