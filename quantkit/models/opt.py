"""OPT: model.decoder.layers[i].self_attn.{q,k,v,out}_proj, fc1, fc2, with LayerNorms that have biases.

Two OPT details matter for folding:
- ``do_layer_norm_before=False`` (OPT-350m) is post-LN: self_attn_layer_norm / final_layer_norm
  normalise the *residual stream after* each block, so they do not feed q/k/v or fc1 alone.
  Folding a scale into them would rescale the residual too, so the norm groups are left out.
- fc1 -> fc2 goes through the activation; folding commutes with it only when
  act(x / s) == act(x) / s for s > 0, i.e. ReLU (OPT's default). Other activations: left out.
"""
from __future__ import annotations

import torch.nn as nn

from quantkit.models.base import LINEAR, NORM, ArchitectureAdapter, InputGroup, resolve
from quantkit.models.layout import LAYER, PLAIN, AttentionLayout, DecoderLayout, MLPLayout

Q, K, V, OUT = "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"
FC1, FC2 = "fc1", "fc2"


class OPTAdapter(ArchitectureAdapter):
    model_types = ("opt",)

    def layers_prefix(self, model: nn.Module) -> str:
        return "model.decoder.layers"

    def embeddings(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """embed_tokens, embed_positions (learned), then project_in when word_embed_proj_dim != hidden."""
        decoder = resolve(model, "model.decoder")
        out = [("model.decoder.embed_tokens", resolve(model, "model.decoder.embed_tokens")),
               ("model.decoder.embed_positions", resolve(model, "model.decoder.embed_positions"))]
        if getattr(decoder, "project_in", None) is not None:
            out.append(("model.decoder.project_in", decoder.project_in))
        return out

    def final_norm(self, model: nn.Module) -> tuple[str, nn.Module] | None:
        """None for post-LN OPT (350m), which has no final norm."""
        norm = getattr(resolve(model, "model.decoder"), "final_layer_norm", None)
        return ("model.decoder.final_layer_norm", norm) if norm is not None else None

    def post_layers(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        out = super().post_layers(model)
        project_out = getattr(resolve(model, "model.decoder"), "project_out", None)
        if project_out is not None:
            out.append(("model.decoder.project_out", project_out))
        return out

    def decoder_layout(self, model: nn.Module) -> DecoderLayout:
        """Learned positions (their table offset by 2), q scaled after its projection, ReLU MLP,
        LayerNorms before (most OPTs) or after (350m) each block."""
        decoder = resolve(model, "model.decoder")
        return DecoderLayout(
            norm=LAYER, attn_norm="self_attn_layer_norm", mlp_norm="final_layer_norm",
            attention=AttentionLayout(qkv=(Q, K, V), out=OUT, query_scaled=True),
            mlp=MLPLayout(PLAIN, (FC1,), FC2, "activation_fn"), embed_tokens="model.decoder.embed_tokens",
            norm_before=bool(model.config.do_layer_norm_before), rotary=False,
            position_embedding="model.decoder.embed_positions",
            position_offset=int(getattr(decoder.embed_positions, "offset", 2)),
            project_in="model.decoder.project_in" if getattr(decoder, "project_in", None) is not None else None)

    def _linear_names(self, layer: nn.Module) -> list[str]:
        return [Q, K, V, OUT, FC1, FC2]

    def sequential_stages(self, layer: nn.Module) -> list[list[str]]:
        return [[Q, K, V], [OUT], [FC1], [FC2]]

    def input_groups(self, layer: nn.Module, config=None) -> list[InputGroup]:
        # Read from the layer itself: it is what actually runs.
        pre_ln = bool(getattr(layer, "do_layer_norm_before", True))
        attn_norm, ffn_norm = resolve(layer, "self_attn_layer_norm"), resolve(layer, "final_layer_norm")
        groups = []
        # A LayerNorm without elementwise_affine has no weight to carry a scale.
        if pre_ln and attn_norm.weight is not None:
            groups.append(InputGroup("self_attn_layer_norm", (Q, K, V), inspect="self_attn", kind=NORM))
        # v -> out_proj: OPT has no GQA, but check the widths like the llama adapter does.
        if resolve(layer, V).out_features == resolve(layer, OUT).in_features:
            groups.append(InputGroup(V, (OUT,), inspect=OUT, kind=LINEAR))
        if pre_ln and ffn_norm.weight is not None:
            # OPT has no mlp wrapper module; fc1's own output is the block output for AWQ's loss.
            groups.append(InputGroup("final_layer_norm", (FC1,), inspect=FC1, kind=NORM))
        if type(getattr(layer, "activation_fn", None)) is nn.ReLU:
            groups.append(InputGroup(FC1, (FC2,), inspect=FC2, kind=LINEAR))
        return groups
