"""Llama-style decoders: llama, mistral, qwen2, qwen3.

They share one module layout (model.layers[i].self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
input_layernorm, post_attention_layernorm, model.norm, model.embed_tokens, model.rotary_emb,
lm_head). Qwen2's q/k/v biases and Qwen3's q_norm/k_norm (applied to q/k *after* the projections)
do not change any mapping: folding keeps each projection's output unchanged.
"""
from __future__ import annotations

import torch.nn as nn

from quantkit.models.base import LINEAR, NORM, ArchitectureAdapter, AttentionBlock, GatedMLP, InputGroup, resolve
from quantkit.models.layout import GATED, RMS, AttentionLayout, DecoderLayout, MLPLayout

Q, K, V, O = "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"
GATE, UP, DOWN = "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"


class LlamaAdapter(ArchitectureAdapter):
    model_types = ("llama", "mistral", "qwen2", "qwen3")

    def layers_prefix(self, model: nn.Module) -> str:
        return "model.layers"

    def embeddings(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        names = ["model.embed_tokens", "model.rotary_emb"]
        return [(name, resolve(model, name)) for name in names]

    def final_norm(self, model: nn.Module) -> tuple[str, nn.Module]:
        return "model.norm", resolve(model, "model.norm")

    def rotary_embedding(self, model: nn.Module) -> nn.Module | None:
        return resolve(model, "model.rotary_emb")

    def _linear_names(self, layer: nn.Module) -> list[str]:
        return [Q, K, V, O, GATE, UP, DOWN]

    def sequential_stages(self, layer: nn.Module) -> list[list[str]]:
        return [[Q, K, V], [O], [GATE, UP], [DOWN]]

    def gated_mlp(self, layer: nn.Module) -> GatedMLP:
        # LlamaMLP, MistralMLP, Qwen2MLP and Qwen3MLP: down_proj(act_fn(gate_proj(x)) * up_proj(x))
        # and their decoder layers are sequential pre-norm blocks: residual + attn, then residual + mlp
        return GatedMLP(module="mlp", gate=GATE, up=UP, down=DOWN, act="mlp.act_fn", sequential_residual=True)

    def attention(self, layer: nn.Module) -> AttentionBlock:
        # q/k/v(hidden) -> rotary -> attention -> o_proj(output), the batch dimension first throughout
        return AttentionBlock(module="self_attn", inputs=(Q, K, V), output=O)

    def decoder_layout(self, model: nn.Module) -> DecoderLayout:
        attn = resolve(self.decoder_layers(model)[0], "self_attn")
        qk_norm = getattr(attn, "q_norm", None) is not None  # Qwen3
        return DecoderLayout(
            norm=RMS, attn_norm="input_layernorm", mlp_norm="post_attention_layernorm",
            attention=AttentionLayout(qkv=(Q, K, V), out=O, q_norm="self_attn.q_norm" if qk_norm else None,
                                      k_norm="self_attn.k_norm" if qk_norm else None),
            mlp=MLPLayout(GATED, (GATE, UP), DOWN, "mlp.act_fn"), embed_tokens="model.embed_tokens",
            sliding_window=sliding_window(model.config))

    def input_groups(self, layer: nn.Module, config=None) -> list[InputGroup]:
        groups = self.attention_groups(layer)
        groups.append(InputGroup("post_attention_layernorm", (GATE, UP), inspect="mlp", kind=NORM, token_wise=True))
        # up -> down: down sees act(gate(x)) * up(x), linear in up's output for any activation.
        groups.append(InputGroup(UP, (DOWN,), inspect=DOWN, kind=LINEAR))
        return groups

    def attention_groups(self, layer: nn.Module) -> list[InputGroup]:
        """The attention's input groups: norm -> q/k/v, and v -> o where that folding is exact."""
        groups = [InputGroup("input_layernorm", (Q, K, V), inspect="self_attn", kind=NORM)]
        # v -> o: attention output is a convex combination of value rows, so scaling v's output
        # channels by 1/s and o's input columns by s is exact. With GQA one v channel feeds
        # num_key_value_groups o columns (AutoAWQ / llm-awq skip the group then); a scale tied across
        # those columns still folds (InputGroup.kv_heads). The test is on the real widths, not on
        # weight shapes: qwen3 can have num_heads*head_dim != hidden_size.
        v, o = resolve(layer, V), resolve(layer, O)
        if v.out_features == o.in_features:
            groups.append(InputGroup(V, (O,), inspect=O, kind=LINEAR))
        elif (kv_heads := gqa_heads(resolve(layer, "self_attn"), v.out_features, o.in_features)) is not None:
            groups.append(InputGroup(V, (O,), inspect=O, kind=LINEAR, kv_heads=kv_heads))
        return groups


def gqa_heads(attention: nn.Module, v_width: int, o_width: int) -> tuple[int, int] | None:
    """(head_dim, n_rep) of a grouped-query attention whose o input is v's heads each repeated n_rep
    times (transformers' repeat_kv), or None when its attributes do not say so."""
    head_dim, n_rep = getattr(attention, "head_dim", None), getattr(attention, "num_key_value_groups", None)
    if not isinstance(head_dim, int) or not isinstance(n_rep, int) or head_dim < 1 or n_rep < 2:
        return None
    if v_width % head_dim or v_width * n_rep != o_width:
        return None
    return head_dim, n_rep


def sliding_window(config):
    """The attention window of a config that uses one (Mistral by default, Qwen2/3 with
    use_sliding_window, Phi-3 whenever sliding_window is set), else None."""
    uses = getattr(config, "use_sliding_window", config.model_type in ("mistral", "phi3"))
    return getattr(config, "sliding_window", None) if uses else None
