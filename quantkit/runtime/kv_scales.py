"""A compressed-tensors checkpoint's calibrated FP8 KV-cache scales (`quantization_config.kv_cache_scheme`,
tensors `<attention>.k_scale` / `v_scale`, written by `quantize --kv-cache-scheme` or llm-compressor),
taken out of the state dict at load, checked, and kept on the model for quantkit's engine: with
`kv_cache_dtype="fp8"` it quantizes the cache with them (quantkit.engine.kv_cache) as vLLM does.

Checked as vLLM checks them (CompressedTensorsKVCacheMethod): 8-bit float, symmetric, strategy tensor
(one scale) or attn_head (one per KV head); zero points, which llm-compressor may store, must be zero.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from quantkit.errors import QuantkitError

ATTR = "kv_cache_scales"  # the model attribute: (k, v) float32 [layers, kv_heads]
_KV_TENSOR = re.compile(r"\.(?:[kv]_scale|[qkv]_zero_point)$")


def calibrated_kv_scales(model: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(k, v) calibrated scales [layers, kv_heads] a loaded checkpoint carried, else None."""
    return getattr(model, ATTR, None)


def take_kv_scales(qcfg, state: dict, where: dict, model: nn.Module, folder: Path) -> None:
    """Pop the KV-cache scale tensors from `state` and attach them to `model` (see ATTR) when the config
    declares a kv_cache_scheme; without one the tensors stay, and the loader refuses them as unknown."""
    scheme = qcfg.get("kv_cache_scheme") if isinstance(qcfg, dict) else None
    if scheme is None:
        return
    where_cfg = f"{folder}/config.json: kv_cache_scheme"
    if not isinstance(scheme, dict):
        raise QuantkitError(f"{where_cfg} must be an object (compressed-tensors' QuantizationArgs)")
    strategy = scheme.get("strategy")
    if scheme.get("type") != "float" or scheme.get("num_bits") != 8 or scheme.get("symmetric") is not True \
            or strategy not in ("tensor", "attn_head") or scheme.get("dynamic") not in (False, None):
        raise QuantkitError(f"{where_cfg} is {scheme.get('num_bits')}-bit {scheme.get('type')} "
                            f"{strategy} symmetric={scheme.get('symmetric')} dynamic={scheme.get('dynamic')}; "
                            "quantkit (like vLLM) reads static symmetric 8-bit float scales per tensor or attn_head")
    from quantkit.kv_calibration import attention_modules

    heads = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    per_layer = {"k": [], "v": []}
    for name, _ in attention_modules(model):
        for kind in ("k", "v"):
            key = f"{name}.{kind}_scale"
            if key not in state:
                raise QuantkitError(f"{folder}: checkpoint is missing tensor {key} (its config declares a "
                                    "kv_cache_scheme); re-export it")
            t = state.pop(key)
            want = 1 if strategy == "tensor" else heads
            if not t.is_floating_point() or t.numel() != want:
                raise QuantkitError(f"{where.get(key, folder)}: tensor {key} is {str(t.dtype).replace('torch.', '')} "
                                    f"{tuple(t.shape)}, a {strategy} kv_cache_scheme needs {want} float scale(s)")
            t = t.float().reshape(-1)
            if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
                raise QuantkitError(f"{where.get(key, folder)}: tensor {key} holds a scale that is not a positive "
                                    "finite number; the checkpoint is damaged, re-export it")
            per_layer[kind].append(t.expand(heads).clone())
    for key in [k for k in state if _KV_TENSOR.search(k)]:
        t = state.pop(key)
        if key.endswith("zero_point") and bool((t != 0).any()):
            raise QuantkitError(f"{where.get(key, folder)}: tensor {key} is not zero; KV-cache scales are symmetric")
        if not key.endswith("zero_point"):
            raise QuantkitError(f"{where.get(key, folder)}: tensor {key} is not under a decoder layer's attention; "
                                "the config and the weights disagree")
    setattr(model, ATTR, (torch.stack(per_layer["k"]), torch.stack(per_layer["v"])))
