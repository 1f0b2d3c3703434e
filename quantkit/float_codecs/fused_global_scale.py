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


def fused_groups(model: torch.nn.Module, quantized: set[str]) -> list[list[str]]:
    """Each set of two or more quantized sibling linears a runtime fuses into one weight (FUSED_SIBLINGS)."""
    out = []
    for parent_name, parent in model.named_modules():
        for group in FUSED_SIBLINGS:
            names = [f"{parent_name}.{c}" if parent_name else c for c in group
                     if isinstance(getattr(parent, c, None), torch.nn.Linear)]
            names = [n for n in names if n in quantized]
            if len(names) >= 2:
                out.append(names)
    return out


def shared_global_scales(model: torch.nn.Module, quantized: set[str]) -> dict[str, torch.Tensor]:
    """{linear name: NVFP4 global scale} for quantized linears with fused siblings: one scale from the absmax
    over all of them (`nvfp4.global_scale`), so each keeps its group scales within E4M3's range."""
    out = {}
    for names in fused_groups(model, quantized):
        amax = torch.stack([model.get_submodule(n).weight.detach().float().abs().amax() for n in names])
        out.update(dict.fromkeys(names, nvfp4.global_scale(amax)))
    return out


def shared_absmax(model: torch.nn.Module, absmax: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`absmax` ({linear: input absmax}) with fused siblings given their joint maximum, so they store one
    input_global_scale as vLLM's fused layer keeps one (siblings read the same input, so this rarely
    changes a value; it makes the sharing explicit)."""
    out = dict(absmax)
    for names in fused_groups(model, set(absmax)):
        joint = torch.stack([absmax[n].reshape(()) for n in names]).amax()
        out.update(dict.fromkeys(names, joint))
    return out
