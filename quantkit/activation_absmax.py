"""Each linear's input absmax over a calibration set, gathered in one forward pass (static activation scales).

Forward pre-hooks on the named linears keep a running max of |input| per linear (no activation is stored),
what compressed-tensors' "static_minmax" observer records for a symmetric scheme. The model runs in
inference mode in batches of `batch_size` sequences; hooks are removed whatever happens.
"""
from __future__ import annotations

from typing import Iterable

import torch

from quantkit.errors import QuantkitError


def input_absmax(model: torch.nn.Module, names: Iterable[str], input_ids: torch.Tensor,
                 batch_size: int = 8) -> dict[str, torch.Tensor]:
    """{linear name: float32 scalar absmax of every input it saw} for `input_ids` [samples, seq_len]. A linear
    that saw no token (an MoE expert never routed to) gets 0."""
    names = list(names)
    if input_ids is None or input_ids.ndim != 2 or input_ids.shape[0] == 0:
        raise QuantkitError("static activation scales need calibration token ids [samples, seq_len]")
    device = next(model.parameters()).device
    amax = {n: torch.zeros((), dtype=torch.float32, device=device) for n in names}
    handles = []

    def recorder(name: str):
        def hook(module, args):
            x = args[0].detach()
            if x.numel():
                amax[name] = torch.maximum(amax[name], x.abs().amax().to(torch.float32))
        return hook

    try:
        for name in names:
            handles.append(model.get_submodule(name).register_forward_pre_hook(recorder(name)))
        with torch.inference_mode():
            for start in range(0, input_ids.shape[0], max(1, batch_size)):
                batch = input_ids[start:start + max(1, batch_size)].to(device)
                model(input_ids=batch, attention_mask=torch.ones_like(batch), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {n: v.cpu() for n, v in amax.items()}
