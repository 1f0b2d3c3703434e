"""Each linear's input absmax over a calibration set, gathered in one forward pass (static activation scales).

Forward pre-hooks on the named linears keep a running max of |input| per linear (no activation is stored),
what compressed-tensors' "static_minmax" observer records for a symmetric scheme. The model runs in
inference mode in batches of `batch_size` sequences, each forward stopped at the LM head unless it is one of
the named linears (its logits, a fifth of a small model's compute, are not needed); hooks are removed whatever
happens.
"""
from __future__ import annotations

from typing import Iterable

import torch

from quantkit.errors import QuantkitError
from quantkit.layer_io import StopForward


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

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    stop_at_head = head is not None and not any(model.get_submodule(n) is head for n in names)

    def stop(module, args):
        raise StopForward  # every hooked linear has run: the LM head's logits are not needed

    try:
        for name in names:
            handles.append(model.get_submodule(name).register_forward_pre_hook(recorder(name)))
        if stop_at_head:
            handles.append(head.register_forward_pre_hook(stop))
        with torch.inference_mode():
            for start in range(0, input_ids.shape[0], max(1, batch_size)):
                batch = input_ids[start:start + max(1, batch_size)].to(device)
                try:
                    model(input_ids=batch, attention_mask=torch.ones_like(batch), use_cache=False)
                except StopForward:
                    pass
    finally:
        for h in handles:
            h.remove()
    return {n: v.cpu() for n, v in amax.items()}
