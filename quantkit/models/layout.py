"""What an inference engine needs to run a family's decoder with its own attention: the forward's
shape, named by module paths. ``ArchitectureAdapter.decoder_layout`` answers it per family, so the
engine holds no family's attribute names (the calibration driver does not use this).

One decoder layer, as every supported family computes it::

    pre-norm (norm_before):   x = x + out(attn(attn_norm(x)));   x = x + mlp(mlp_norm(x))
    post-norm (OPT-350m):     x = attn_norm(x + out(attn(x)));   x = mlp_norm(x + mlp(x))

attention: q, k, v from one fused projection ([q | k | v] rows) or three; optional per-head q/k
RMSNorm (Qwen3) before rotary; rotary positions or none (OPT adds learned position embeddings to
the input instead, and scales q by head_dim^-0.5 after its projection). MLP: ``down(act(gate) *
up)`` from two projections or one fused [gate | up] one (Phi-3), or ``fc2(act(fc1(x)))`` (OPT).
Mixture-of-Experts families replace the MLP of their sparse layers (the adapter's ``moe_blocks``)
by a `MoELayout`: a router picks top-k experts per token, whose gated MLPs are summed with the
router's weights, plus a shared expert where the family has one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

RMS = "rms"
LAYER = "layer"  # nn.LayerNorm (weight and bias)
GATED = "gated"  # down(act(gate(x)) * up(x)), gate and up apart or fused [gate | up]
PLAIN = "plain"  # fc2(act(fc1(x)))


@dataclass(frozen=True)
class LatentAttentionLayout:
    """DeepSeek's multi-head latent attention (MLA), paths relative to the layer: q from ``q`` (q_a_proj,
    q_a_layernorm, q_b_proj, or q_proj alone), the latent ``kv_a`` [kv_lora_rank | rope_dim] whose first
    part is normed (``kv_a_norm``) and expanded per head by ``kv_b`` into [nope_dim | v_dim], the second
    part one rotary key shared by every head; ``interleaved``: rotary pairs (x0, x1), (x2, x3), ... as
    DeepSeek's checkpoints lay them out; ``scale`` the softmax scale (qk_head_dim^-0.5, yarn's mscale^2)."""
    q: tuple[str, ...]
    kv_a: str
    kv_a_norm: str
    kv_b: str
    nope_dim: int
    rope_dim: int
    v_dim: int
    kv_lora_rank: int
    interleaved: bool
    scale: float


@dataclass(frozen=True)
class AttentionLayout:
    qkv: tuple[str, ...]  # (q, k, v) projections, or one fused projection with rows [q | k | v]
    out: str
    q_norm: Optional[str] = None  # per-head RMSNorm on q and k before rotary (Qwen3)
    k_norm: Optional[str] = None
    query_scaled: bool = False  # q = q_proj(x) * head_dim^-0.5 in the model; attention itself unscaled (OPT)
    qk_norm_whole: bool = False  # q/k RMSNorm over the whole projection before the heads split (OLMoE)
    latent: Optional[LatentAttentionLayout] = None  # MLA (DeepSeek-V3): q, k, v from latents; qkv is ()


@dataclass(frozen=True)
class MLPLayout:
    kind: str  # GATED or PLAIN
    up: tuple[str, ...]  # GATED: (gate, up) or (fused gate_up,) with rows [gate | up]; PLAIN: (fc1,)
    down: str
    act: str  # the activation module


SOFTMAX = "softmax"  # softmax over the router logits in fp32, top-k, renormalised when asked (Mixtral always)
SIGMOID_GROUPED = "sigmoid_grouped"  # DeepSeek-V3: sigmoid scores, group-limited top-k on score + bias


@dataclass(frozen=True)
class MoELayout:
    """A sparse block (paths relative to the layer): the router (weight [E, H]), the experts (per-expert
    linears ``{experts}.{e}.gate_proj/up_proj/down_proj``, or transformers' fused 3-D weights), and
    how the router's scores become each token's top-k experts and their weights."""
    router: str
    experts: str
    top_k: int
    scoring: str = SOFTMAX
    renormalize: bool = True  # top-k weights divided by their sum
    shared: Optional[str] = None  # a gated MLP every token goes through (Qwen2-MoE, DeepSeek-V3)
    shared_gate: Optional[str] = None  # sigmoid(shared_gate(x)) scales the shared expert (Qwen2-MoE)
    score_bias: Optional[str] = None  # added to the scores for the choice only (DeepSeek's e_score_correction_bias)
    n_group: int = 1  # SIGMOID_GROUPED: experts in n_group groups, tokens pick topk_group of them
    topk_group: int = 1
    scaling: float = 1.0  # the chosen weights times this (DeepSeek's routed_scaling_factor)


@dataclass(frozen=True)
class DecoderLayout:
    """Module paths of one family: model-level ones from the model, layer-level ones from a decoder layer."""
    norm: str  # RMS or LAYER, for every norm of the model
    attn_norm: str
    mlp_norm: str
    attention: AttentionLayout
    mlp: MLPLayout
    embed_tokens: str
    norm_before: bool = True  # pre-norm; False: post-norm (OPT with do_layer_norm_before=False)
    rotary: bool = True  # rotary embeddings from the config; False: none
    position_embedding: Optional[str] = None  # learned absolute positions added to the input (OPT)
    position_offset: int = 0  # OPT's table starts at position -2
    project_in: Optional[str] = None  # after the token embedding (OPT with word_embed_proj_dim != hidden)
    sliding_window: Optional[int] = None  # tokens a query may see; the engine keeps requests within it
    moe: Optional[MoELayout] = None  # the sparse layers' block (which layers are sparse: the adapter's moe_blocks)
