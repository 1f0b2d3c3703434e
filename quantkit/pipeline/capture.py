"""The calibration set as decoder layer 0 receives it, and a layer's outputs for the next layer."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.layer_io import StopForward, layer_output, to_device


@torch.no_grad()
def capture_layer_inputs(model, adapter, input_ids: torch.Tensor, batch_size: int, device, activation_device,
                         compute_dtype: Optional[torch.dtype] = None, batches=None) -> list:
    """Run the model up to decoder layer 0 and record (hidden_states, kwargs) per batch: `batch_size`
    sequences at a time, or the (start, stop) rows of `input_ids` in `batches`.

    With `compute_dtype`, the modules before layer 0 run with their parameters in it (the model may
    be held in its bf16/fp16 storage dtype): the hidden states, masks and rotary tables then come out
    exactly as from a model loaded in `compute_dtype`. Buffers are left alone (rotary `inv_freq`
    stays fp32 in a bf16 model and must not be rounded on the way back)."""
    layers = adapter.decoder_layers(model)
    first = layers[0]
    captured = []

    class Catcher(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, hidden_states, *args, **kwargs):
            if args:
                raise QuantkitError("decoder layer received positional arguments the driver cannot replay")
            kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_value", "past_key_values")}
            kwargs["use_cache"] = False
            captured.append((hidden_states.to(activation_device), to_device(kwargs, activation_device)))
            raise StopForward

    pre_modules = [m for _, m in adapter.embeddings(model)]
    for m in pre_modules:
        m.to(device)
    # the originals are put back afterwards, not re-cast: a bf16 embedding viewing the safetensors
    # mapping would otherwise come back as a fresh 54 MB copy (the demo's) in anonymous memory
    stored = {p: p.data for m in pre_modules for p in m.parameters()} if compute_dtype is not None else {}
    for p in stored:
        p.data = p.data.to(compute_dtype)
    layers[0] = Catcher(first)
    try:
        for start, stop in batches or [(s, s + batch_size) for s in range(0, input_ids.shape[0], batch_size)]:
            try:
                model(input_ids=input_ids[start:stop].to(device), use_cache=False)
            except StopForward:
                pass
    finally:
        layers[0] = first
        for p, original in stored.items():
            p.data = original
        for m in pre_modules:
            m.to(activation_device)
    return captured


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: list, device, compute_dtype: torch.dtype, activation_device) -> list:
    """The layer's output hidden states for every calibration batch, back on `activation_device`."""
    return [layer_output(layer(to_device(hidden, device).to(compute_dtype), **to_device(kwargs, device)))
            .to(activation_device) for hidden, kwargs in inputs]
