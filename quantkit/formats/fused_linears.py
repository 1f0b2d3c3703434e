"""Linears that serving engines fuse into one matrix, and so must share one quantization scheme.

vLLM builds q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (its models'
`packed_modules_mapping`) and gives the fused layer one quantization method: a gptq `dynamic` rule is
matched against the fused name (`utils/gptq_utils.py` `get_dynamic_override`, with the layer's prefix,
e.g. `model.layers.0.self_attn.qkv_proj`), and every shard is loaded into tensors shaped for that one
scheme (a shard at another group size or bit width fails `load_qkv_weight`'s shape assertion).
So a mixture meant to be served keeps each group at one scheme (quantkit.allocation), and the gptq
writer states a group's override under the fused name too.
"""
from __future__ import annotations

from typing import Iterable

# vLLM's fused name -> the checkpoint's linears it stacks (Llama, Mistral, Qwen2/3, Mixtral attention...)
VLLM_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused_groups(names: Iterable[str]) -> dict[str, list[str]]:
    """{fused module name: its member linears} for every complete group among `names` (same parent)."""
    present = set(names)
    groups: dict[str, list[str]] = {}
    for name in sorted(present):
        parent, _, leaf = name.rpartition(".")
        for fused, members in VLLM_FUSED.items():
            if leaf == members[0]:
                full = [f"{parent}.{m}" if parent else m for m in members]
                if all(m in present for m in full):
                    groups[f"{parent}.{fused}" if parent else fused] = full
    return groups
