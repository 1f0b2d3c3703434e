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

from quantkit.errors import QuantkitError, first_line
from quantkit.finite import require_finite
from quantkit.formats.ct_float_layouts import float_groups, group_of
from quantkit.notices import notice
from quantkit.runtime.float_linear import FloatLinear
from quantkit.runtime.loader import (_assign_state, _cast_unquantized, _check_layer_count, default_compute_dtype,
                                     experts_as_linears, read_state_dict, unquantized_config)


def load_float_model(folder: Path, qcfg: dict, files: list[Path], backend: str, device: torch.device,
                     dtype: Optional[str], trust_remote_code: bool):
    """The transformers model of a float checkpoint in `folder`, its quantized linears `FloatLinear`s."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from quantkit.sources import parse_dtype

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
    config = unquantized_config(folder, trust_remote_code)
    act_dtype = parse_dtype(dtype) or default_compute_dtype(config, device)
    state, where = read_state_dict(files, with_files=True)
    _check_layer_count(config, state, folder)
    try:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=act_dtype, trust_remote_code=trust_remote_code)
    except Exception as exc:  # a config transformers cannot build from
        raise QuantkitError(f"{folder}/config.json: cannot build the model ({first_line(exc)})") from None
    adapter = experts_as_linears(model)
    if adapter is not None:  # the checkpoint's names (Mixtral's block_sparse_moe.experts.e.w1) -> the model's
        state, where = ({adapter.model_name(k): v for k, v in d.items()} for d in (state, where))
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
    _assign_state(model, state, folder, where)
    _cast_unquantized(model, act_dtype)
    model.to(device)
    model.eval()
    for name, layer in floats.items():
        for suffix in layer.packed_shapes:
            t = getattr(layer, suffix)
            if t.dtype != torch.float8_e4m3fn:  # float8 codes are checked through the dequantized weight
                require_finite(f"{rename(name)}.{suffix}", t, layer.source)
        require_finite(f"{rename(name)} (dequantized weight)", layer.dequantized_weight(act_dtype), layer.source)
    return model
