"""Phi-3: llama layout with fused projections (self_attn.qkv_proj, mlp.gate_up_proj).

qkv_proj's output rows are [q | k | v] (num_heads*head_dim, then num_key_value_heads*head_dim
twice); gate_up_proj's are [gate | up] (``chunk(2)``, gate first, down sees ``up * act(gate)``).
A scale folded into a fused ``prev`` may touch only the rows feeding the next linear, which the
groups say through ``InputGroup.prev_rows``.
"""
from __future__ import annotations

import torch.nn as nn

from quantkit.errors import QuantkitError
from quantkit.models.base import LINEAR, NORM, AttentionBlock, InputGroup, resolve
from quantkit.models.layout import GATED, RMS, AttentionLayout, DecoderLayout, MLPLayout
from quantkit.models.llama import LlamaAdapter, gqa_heads, sliding_window

QKV, O = "self_attn.qkv_proj", "self_attn.o_proj"
GATE_UP, DOWN = "mlp.gate_up_proj", "mlp.down_proj"


class Phi3Adapter(LlamaAdapter):
    """Same whole-model layout as llama (model.layers, model.norm, model.rotary_emb, lm_head)."""

    model_types = ("phi3",)

    def _linear_names(self, layer: nn.Module) -> list[str]:
        return [QKV, O, GATE_UP, DOWN]

    def sequential_stages(self, layer: nn.Module) -> list[list[str]]:
        return [[QKV], [O], [GATE_UP], [DOWN]]

    def gated_mlp(self, layer: nn.Module) -> None:
        return None  # gate and up are one fused linear: no separate gate/up modules to chunk

    def attention(self, layer: nn.Module) -> AttentionBlock:
        return AttentionBlock(module="self_attn", inputs=(QKV,), output=O)

    def decoder_layout(self, model: nn.Module) -> DecoderLayout:
        return DecoderLayout(
            norm=RMS, attn_norm="input_layernorm", mlp_norm="post_attention_layernorm",
            attention=AttentionLayout(qkv=(QKV,), out=O), mlp=MLPLayout(GATED, (GATE_UP,), DOWN, "mlp.activation_fn"),
            embed_tokens="model.embed_tokens", sliding_window=sliding_window(model.config))

    def input_groups(self, layer: nn.Module, config=None) -> list[InputGroup]:
        qkv, o = resolve(layer, QKV), resolve(layer, O)
        gate_up, down = resolve(layer, GATE_UP), resolve(layer, DOWN)
        attn = resolve(layer, "self_attn")
        groups = [InputGroup("input_layernorm", (QKV,), inspect="self_attn", kind=NORM)]

        # qkv -> o, folded into the v rows only (the last kv_heads*head_dim rows); with GQA the
        # scale is tied across the o columns one v row feeds, as for llama. AutoAWQ folds into
        # "the last o_proj.in_features rows" unconditionally, which with GQA (e.g. Phi-3-medium,
        # 40 q / 10 kv heads) rescales k rows too and changes the model; llm-compressor's Phi-3
        # mapping has the same hazard.
        v_width = _kv_heads(attn, config) * attn.head_dim
        if qkv.out_features != o.in_features + 2 * v_width:
            raise QuantkitError(
                f"Phi-3 qkv_proj has {qkv.out_features} outputs, expected q+k+v = "
                f"{o.in_features}+{v_width}+{v_width}; unsupported layout"
            )
        v_rows = (qkv.out_features - v_width, qkv.out_features)
        if v_width == o.in_features:
            groups.append(InputGroup(QKV, (O,), inspect=O, kind=LINEAR, prev_rows=v_rows))
        elif (kv_heads := gqa_heads(attn, v_width, o.in_features)) is not None:
            groups.append(InputGroup(QKV, (O,), inspect=O, kind=LINEAR, prev_rows=v_rows, kv_heads=kv_heads))

        groups.append(InputGroup("post_attention_layernorm", (GATE_UP,), inspect="mlp", kind=NORM, token_wise=True))

        # gate_up -> down, folded into the up half only: down sees up * act(gate), linear in up,
        # while rescaling gate rows would go through the nonlinearity.
        inter = down.in_features
        if gate_up.out_features != 2 * inter:
            raise QuantkitError(
                f"Phi-3 gate_up_proj has {gate_up.out_features} outputs, expected 2*{inter}; unsupported layout"
            )
        groups.append(InputGroup(GATE_UP, (DOWN,), inspect=DOWN, kind=LINEAR, prev_rows=(inter, 2 * inter)))
        return groups


def _kv_heads(attn: nn.Module, config) -> int:
    """num_key_value_heads from the attention module (what runs), else from the config."""
    n = getattr(attn, "num_key_value_heads", None)
    if n is None:
        n = getattr(config if config is not None else getattr(attn, "config", None), "num_key_value_heads", None)
    if n is None:
        raise QuantkitError("cannot tell Phi-3 num_key_value_heads from the layer or config")
    return int(n)
