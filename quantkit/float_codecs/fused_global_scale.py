"""NVFP4's global scale shared by linears a runtime fuses into one weight.

vLLM builds q/k/v as one qkv_proj and gate/up as one gate_up_proj (DeepSeek's q_a/kv_a as fused_qkv_a_proj,
Mixtral's w1/w3 as w13) and keeps one NVFP4 global scale per fused weight, so those siblings must be written
with the same one, computed from their joint absmax (llm-compressor's `observers/helpers.FUSED_LAYER_NAMES`;
transformers' MoE loader likewise keeps a single value for gate/up).
"""
from __future__ import annotations

import torch

from quantkit.float_codecs import nvfp4

FUSED_SIBLINGS = (("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj"), ("q_a_proj", "kv_a_proj_with_mqa"),
                  ("w1", "w3"))


def shared_global_scales(model: torch.nn.Module, quantized: set[str]) -> dict[str, torch.Tensor]:
    """{linear name: NVFP4 global scale} for quantized linears with fused siblings: one scale from the absmax
    over all of them (`nvfp4.global_scale`), so each keeps its group scales within E4M3's range."""
    out = {}
    for parent_name, parent in model.named_modules():
        for group in FUSED_SIBLINGS:
            names = [f"{parent_name}.{c}" if parent_name else c for c in group
                     if isinstance(getattr(parent, c, None), torch.nn.Linear)]
            names = [n for n in names if n in quantized]
            if len(names) < 2:
                continue
            amax = torch.stack([model.get_submodule(n).weight.detach().float().abs().amax() for n in names])
            out.update(dict.fromkeys(names, nvfp4.global_scale(amax)))
    return out
