"""Mixture-of-Experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3.

In transformers 5 a sparse block is ``mlp`` with a router ``mlp.gate`` (a TopKRouter, weight [E, H],
not an nn.Linear) and the routed experts ``mlp.experts`` as one module of fused 3-D weights. While
a layer is calibrated (and in a loaded quantized model) the experts are per-expert linears
``mlp.experts.{e}.gate_proj/up_proj/down_proj`` (quantkit.models.experts); the groups and stages
below name them only when the layer has them, so nothing here ever describes a layout the layer
does not have.

Per family (from transformers 5.24's modeling files):
- Mixtral: every layer sparse; softmax -> top-k -> renormalise. Its checkpoints (and vLLM) name the
  block ``block_sparse_moe`` and the projections w1 (gate), w3 (up), w2 (down).
- Qwen2-MoE: a layer is sparse unless listed in ``mlp_only_layers`` or (L+1) % decoder_sparse_step
  != 0; a shared expert (``mlp.shared_expert``, a gated MLP) scaled by sigmoid(``shared_expert_gate``).
- Qwen3-MoE: as Qwen2-MoE without the shared expert; q_norm/k_norm per head in attention.
- OLMoE: every layer sparse; q_norm/k_norm over the whole projection.
- DeepSeek-V3: layers below ``first_k_dense_replace`` dense; sigmoid router with a score-correction
  bias and group-limited top-k; ``mlp.shared_experts``; MLA attention (q_a_proj -> q_a_layernorm ->
  q_b_proj, or q_proj; kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj; o_proj), all quantized.
Routers and shared-expert gates stay in full precision (vLLM builds them unquantized).
"""
from __future__ import annotations

import math
import re
from dataclasses import replace

import torch.nn as nn

from quantkit.errors import QuantkitError
from quantkit.models.base import (EXPERT_PROJECTIONS, LINEAR, NORM, AttentionBlock, GatedMLP, InputGroup, MoEBlock,
                                  resolve)
from quantkit.models.layout import SIGMOID_GROUPED, AttentionLayout, DecoderLayout, LatentAttentionLayout, MoELayout
from quantkit.models.llama import DOWN, GATE, K, O, Q, UP, V, LlamaAdapter

GATE_UP = ("gate_proj", "up_proj")


class MoEAdapter(LlamaAdapter):
    """Llama-style layers whose MLP may be a sparse MoE block (see the module docstring)."""

    shared_name: str | None = None
    shared_gate_name: str | None = None

    def moe_blocks(self, layer: nn.Module) -> list[MoEBlock]:
        mlp = getattr(layer, "mlp", None)
        experts = getattr(mlp, "experts", None)
        if experts is None or not hasattr(mlp, "gate"):
            return []
        shared = self.shared_name if self.shared_name and hasattr(mlp, self.shared_name) else None
        shared_gate = self.shared_gate_name if self.shared_gate_name and hasattr(mlp, self.shared_gate_name) else None
        return [MoEBlock(module="mlp", router="mlp.gate", experts="mlp.experts", num_experts=int(experts.num_experts),
                         shared=f"mlp.{shared}" if shared else None,
                         shared_gate=f"mlp.{shared_gate}" if shared_gate else None)]

    @staticmethod
    def unfused(layer: nn.Module, block: MoEBlock) -> bool:
        """Whether the block's experts are per-expert linears right now (calibration, loaded model)."""
        return isinstance(resolve(layer, block.experts), nn.ModuleList)

    # -- attention (Llama form; DeepSeek overrides) ---------------------------------------------
    def attention_linears(self, layer: nn.Module) -> list[str]:
        return [Q, K, V, O]

    def attention_stages(self, layer: nn.Module) -> list[list[str]]:
        return [[Q, K, V], [O]]

    # -- the layer --------------------------------------------------------------------------------
    def _linear_names(self, layer: nn.Module) -> list[str]:
        blocks = self.moe_blocks(layer)
        if not blocks:
            return self.attention_linears(layer) + [GATE, UP, DOWN]
        names = self.attention_linears(layer)
        for b in blocks:
            names += b.shared_linears(EXPERT_PROJECTIONS) + ([b.shared_gate] if b.shared_gate else [])
            names += b.expert_linears(EXPERT_PROJECTIONS) if self.unfused(layer, b) else []
        return names

    def sequential_stages(self, layer: nn.Module) -> list[list[str]]:
        blocks = self.moe_blocks(layer)
        if not blocks:
            return self.attention_stages(layer) + [[GATE, UP], [DOWN]]
        gate_up, down = [], []
        for b in blocks:
            experts = self.unfused(layer, b)
            gate_up += b.shared_linears(GATE_UP) + (b.expert_linears(GATE_UP) if experts else [])
            down += b.shared_linears(("down_proj",)) + (b.expert_linears(("down_proj",)) if experts else [])
        return self.attention_stages(layer) + [gate_up, down]

    def gated_mlp(self, layer: nn.Module) -> GatedMLP | None:
        return None if self.moe_blocks(layer) else super().gated_mlp(layer)

    def input_groups(self, layer: nn.Module, config=None) -> list[InputGroup]:
        blocks = self.moe_blocks(layer)
        if not blocks:
            return super().input_groups(layer, config)
        groups = self.attention_groups(layer)
        for b in blocks:
            if not self.unfused(layer, b):
                continue  # a scale folded into the norm must reach every expert: only per-expert linears can take it
            groups.append(InputGroup("post_attention_layernorm", tuple(b.shared_linears(GATE_UP) + b.expert_linears(GATE_UP)),
                                     inspect=b.module, kind=NORM, token_wise=True, input_of=b.module,
                                     followers=(b.router,) + ((b.shared_gate,) if b.shared_gate else ())))
            if b.shared:
                groups.append(InputGroup(f"{b.shared}.up_proj", (f"{b.shared}.down_proj",),
                                         inspect=f"{b.shared}.down_proj", kind=LINEAR))
            groups += [InputGroup(b.expert_linear(e, "up_proj"), (b.expert_linear(e, "down_proj"),),
                                  inspect=b.expert_linear(e, "down_proj"), kind=LINEAR) for e in range(b.num_experts)]
        return groups

    # -- the engine ------------------------------------------------------------------------------
    def decoder_layout(self, model: nn.Module) -> DecoderLayout:
        """Llama's layout; sparse layers (moe_blocks) run `moe_layout` instead of the dense MLP."""
        return replace(super().decoder_layout(model), moe=self.moe_layout(model.config))

    def moe_layout(self, config) -> MoELayout:
        """Softmax -> top-k, renormalised when the config says (norm_topk_prob), plus the shared expert."""
        return MoELayout(router="mlp.gate", experts="mlp.experts", top_k=int(config.num_experts_per_tok),
                         renormalize=bool(getattr(config, "norm_topk_prob", True)),
                         shared=f"mlp.{self.shared_name}" if self.shared_name else None,
                         shared_gate=f"mlp.{self.shared_gate_name}" if self.shared_gate_name else None)

    # -- the whole model --------------------------------------------------------------------------
    def linear_shapes(self, model: nn.Module) -> dict[str, tuple[int, int]]:
        gates = set(self._shared_gates(model))
        return {n: s for n, s in super().linear_shapes(model).items() if n not in gates}

    def _shared_gates(self, model: nn.Module) -> list[str]:
        prefix = self.layers_prefix(model)
        return [f"{prefix}.{i}.{b.shared_gate}" for i, layer in enumerate(self.decoder_layers(model))
                for b in self.moe_blocks(layer) if b.shared_gate]

    def full_precision_modules(self, model: nn.Module) -> list[str]:
        prefix = self.layers_prefix(model)
        routers = [f"{prefix}.{i}.{b.router}" for i, layer in enumerate(self.decoder_layers(model))
                   for b in self.moe_blocks(layer)]
        return routers + self._shared_gates(model)


class MixtralAdapter(MoEAdapter):
    model_types = ("mixtral",)
    _TO_CHECKPOINT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    _TO_MODEL = {v: k for k, v in _TO_CHECKPOINT.items()}

    def checkpoint_name(self, name: str) -> str:
        name = re.sub(r"(layers\.\d+)\.mlp\.", r"\1.block_sparse_moe.", name)
        return re.sub(r"(experts\.\d+\.)(gate_proj|up_proj|down_proj)(?=\.|$)",
                      lambda m: m.group(1) + self._TO_CHECKPOINT[m.group(2)], name)

    def model_name(self, name: str) -> str:
        name = re.sub(r"(layers\.\d+)\.block_sparse_moe\.", r"\1.mlp.", name)
        return re.sub(r"(experts\.\d+\.)(w1|w2|w3)(?=\.|$)", lambda m: m.group(1) + self._TO_MODEL[m.group(2)], name)

    def decoder_layout(self, model: nn.Module) -> DecoderLayout:
        # Mixtral's attention uses config.sliding_window whenever it is set (its "main diff with Llama")
        return replace(super().decoder_layout(model), sliding_window=getattr(model.config, "sliding_window", None))

    def moe_layout(self, config) -> MoELayout:
        return replace(super().moe_layout(config), renormalize=True)  # softmax -> top-k -> renormalise, always


class Qwen2MoEAdapter(MoEAdapter):
    model_types = ("qwen2_moe",)
    shared_name = "shared_expert"
    shared_gate_name = "shared_expert_gate"


class Qwen3MoEAdapter(MoEAdapter):
    model_types = ("qwen3_moe",)


class OlmoeAdapter(MoEAdapter):
    model_types = ("olmoe",)

    def attention(self, layer: nn.Module) -> AttentionBlock | None:
        return None  # q_norm/k_norm over the whole projection: run the module whole

    def decoder_layout(self, model: nn.Module) -> DecoderLayout:
        if getattr(model.config, "clip_qkv", None) is not None:
            raise QuantkitError("the engine does not run OLMoE with clip_qkv set yet")
        layout = super().decoder_layout(model)
        return replace(layout, attention=replace(layout.attention, qk_norm_whole=True))


def mla_softmax_scale(config) -> float:
    """DeepSeek's attention scale: qk_head_dim^-0.5, times yarn's mscale(factor, mscale_all_dim)^2 when the
    rope is scaled (transformers' yarn_apply_mscale / yarn_get_mscale)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    mscale_all_dim = params.get("mscale_all_dim", 0) if params.get("rope_type", "default") != "default" else 0
    if mscale_all_dim:
        factor = params["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


Q_A, Q_B, Q_PLAIN = "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.q_proj"
KV_A, KV_B = "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj"


class DeepseekV3Adapter(MoEAdapter):
    """MLA attention: q_a_proj -> q_a_layernorm -> q_b_proj (q_proj when q_lora_rank is None),
    kv_a_proj_with_mqa -> kv_a_layernorm (on its first kv_lora_rank outputs) -> kv_b_proj, o_proj;
    the forward runs them in that order, one stage each."""

    model_types = ("deepseek_v3",)
    shared_name = "shared_experts"

    @staticmethod
    def _q(layer: nn.Module) -> list[str]:
        return [Q_A, Q_B] if getattr(resolve(layer, "self_attn"), "q_a_proj", None) is not None else [Q_PLAIN]

    def attention_linears(self, layer: nn.Module) -> list[str]:
        return self._q(layer) + [KV_A, KV_B, O]

    def attention_stages(self, layer: nn.Module) -> list[list[str]]:
        return [[n] for n in self.attention_linears(layer)]

    def attention_groups(self, layer: nn.Module) -> list[InputGroup]:
        q = self._q(layer)
        groups = [InputGroup("input_layernorm", (q[0], KV_A), inspect="self_attn", kind=NORM)]
        if len(q) == 2:
            groups.append(InputGroup("self_attn.q_a_layernorm", (Q_B,), inspect=Q_B, kind=NORM))
        groups.append(InputGroup("self_attn.kv_a_layernorm", (KV_B,), inspect=KV_B, kind=NORM))
        return groups

    def attention(self, layer: nn.Module) -> AttentionBlock | None:
        return None  # MLA: run the module whole

    def decoder_layout(self, model: nn.Module) -> DecoderLayout:
        """Llama's layout with MLA attention (the engine expands the latents per head: engine.latent_attention)."""
        c = model.config
        q = self._q(self.decoder_layers(model)[0])
        latent = LatentAttentionLayout(
            q=(Q_A, "self_attn.q_a_layernorm", Q_B) if len(q) == 2 else (Q_PLAIN,), kv_a=KV_A,
            kv_a_norm="self_attn.kv_a_layernorm", kv_b=KV_B, nope_dim=int(c.qk_nope_head_dim),
            rope_dim=int(c.qk_rope_head_dim), v_dim=int(c.v_head_dim), kv_lora_rank=int(c.kv_lora_rank),
            interleaved=bool(getattr(c, "rope_interleave", False)), scale=mla_softmax_scale(c))
        layout = super().decoder_layout(model)
        return replace(layout, attention=AttentionLayout(qkv=(), out=O, latent=latent))

    def moe_layout(self, config) -> MoELayout:
        """Sigmoid scores; the choice on score + e_score_correction_bias, limited to the topk_group groups
        whose best two scores sum highest; weights the chosen scores, renormalised, times routed_scaling_factor."""
        return replace(super().moe_layout(config), scoring=SIGMOID_GROUPED, score_bias="mlp.gate.e_score_correction_bias",
                       n_group=int(config.n_group), topk_group=int(config.topk_group),
                       scaling=float(config.routed_scaling_factor))
