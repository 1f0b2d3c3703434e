"""`quantkit.load` for compressed-tensors float checkpoints (float-quantized, nvfp4-pack-quantized,
mxfp4-pack-quantized: the FP8 / NVFP4 / MXFP4 presets), ours or llm-compressor's.

The model is built on the meta device as `runtime.loader` builds it (routed experts as per-expert linears),
every linear a config group targets becomes a `FloatLinear` holding that linear's tensors (dtype and shape
checked against the config before anything is copied), the rest of the state dict is assigned as usual, and
every weight is dequantized once at load so that a damaged scale is refused now, naming its tensor.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.finite import require_finite
from quantkit.formats.ct_float_layouts import float_groups, group_of
from quantkit.notices import notice
from quantkit.runtime.float_linear import FloatLinear
from quantkit.runtime.loader import empty_model_and_state, fill_and_place


# scale dtypes a writer may use (compressed-tensors stores most scales in the model's dtype) that convert to the
# dtype the layout declares without loss; anything else is refused as a mismatch
_WIDENS_TO = {torch.float32: (torch.bfloat16, torch.float16)}


def load_float_model(folder: Path, qcfg: dict, files: list[Path], backend: str, device: torch.device,
                     dtype: Optional[str], trust_remote_code: bool):
    """The transformers model of a float checkpoint in `folder`, its quantized linears `FloatLinear`s."""
    if backend not in ("auto", "reference"):
        notice(f"quantkit: float checkpoints run on the reference path (dequantized weights); backend {backend} "
               "has no float kernel")
    try:
        groups = float_groups(qcfg)
    except QuantkitError as exc:
        raise QuantkitError(f"{folder}/config.json: {exc}") from None
    ignore = qcfg.get("ignore") or []
    if not isinstance(ignore, list):
        raise QuantkitError(f"{folder}/config.json: quantization_config's ignore must be a list")
    model, act_dtype, state, where, adapter = empty_model_and_state(folder, files, dtype, device, trust_remote_code)
    rename = adapter.checkpoint_name if adapter is not None else (lambda n: n)
    floats = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        group = group_of(rename(name), groups, ignore)
        if group is None:
            continue
        try:
            layer = FloatLinear(group.layout, group.weights, group.input_activations, module.in_features,
                                module.out_features, bias=f"{name}.bias" in state, dtype=act_dtype)
        except QuantkitError as exc:
            raise QuantkitError(f"{folder}/config.json: {name}: {exc}") from None
        for suffix, (shape, want) in layer.packed_shapes.items():
            key = f"{name}.{suffix}"
            if key not in state:
                raise QuantkitError(f"{folder}: checkpoint is missing tensor {rename(name)}.{suffix} "
                                    f"({group.layout.FORMAT} linear)")
            t = state.pop(key)
            if t.dtype in _WIDENS_TO.get(want, ()):  # e.g. llm-compressor's bfloat16 scales of a bf16 model
                t = t.to(want)
            if t.dtype != want or tuple(t.shape) != tuple(shape):
                raise QuantkitError(f"{where[key]}: tensor {rename(name)}.{suffix} is {str(t.dtype).replace('torch.', '')} "
                                    f"{tuple(t.shape)}, the config implies {str(want).replace('torch.', '')} "
                                    f"{tuple(shape)}; the config and the weights disagree")
            setattr(layer, suffix, t)
        layer.source = f"{where[f'{name}.{next(iter(layer.packed_shapes))}']} ({rename(name)})"
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        floats[name] = layer
    if not floats:
        raise QuantkitError(f"{folder}/config.json: no linear of this model matches a config group's targets")
    fill_and_place(model, state, where, folder, act_dtype, device)
    for name, layer in floats.items():
        for suffix in layer.packed_shapes:
            t = getattr(layer, suffix)
            if t.dtype != torch.float8_e4m3fn:  # float8 codes are checked through the dequantized weight
                require_finite(f"{rename(name)}.{suffix}", t, layer.source)
        require_finite(f"{rename(name)} (dequantized weight)", layer.dequantized_weight(act_dtype), layer.source)
    return model
