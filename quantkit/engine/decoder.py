"""The model the engine runs, resolved once from a transformers model through its family's adapter.

``quantkit.models`` says where a family keeps its parts and what shape its forward has
(``ArchitectureAdapter.decoder_layout``); here each part becomes a plain callable: a projection is
``F.linear`` for an ``nn.Linear`` (threaded by output rows where bit-equal, engine.sliced_linear; in
fp32 on CPU, up to 16 rows through the fp32 decode kernel, see :func:`few_rows_linear_fn`) or
its backend's direct entry for a ``QuantLinear``, a norm is the functional form of what the
module computes, bit for bit. A batch-1 CPU decode step of a small model calls a few hundred of
them and is bound by per-call overhead, which module and backend dispatch would double.

A :class:`DecoderModel` is resolved for a device and a set of backends: rebuild the runner after
moving the model or switching its QuantLinear backends.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.engine.sliced_linear import linear_fn
from quantkit.errors import QuantkitError
from quantkit.models import get_adapter
from quantkit.models.base import resolve
from quantkit.models.norms import rms_norm
from quantkit.models.layout import GATED, LAYER, RMS, DecoderLayout


def matmul_fn(module: nn.Module, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """`module` (a projection) as a plain callable on [N, in] activations in `dtype`, computing
    what its forward does: ``F.linear`` for an ``nn.Linear`` (threaded by output rows where a probe on
    this machine finds that bit-equal, see engine.sliced_linear; a few fp32 rows through the C kernel,
    within fp32 rounding of it but not bit-equal, see few_rows_linear_fn), the backend's direct entry
    for a ``QuantLinear``, the module itself otherwise (and for a hooked one, e.g. accelerate's offload)."""
    from quantkit.runtime.quant_linear import QuantLinear

    if is_plain_linear(module):
        return few_rows_linear_fn(module.weight, module.bias, dtype)
    if isinstance(module, QuantLinear):
        return module.matmul_fn(dtype)
    return module


def is_plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` whose forward is just ``F.linear`` (no hooks, e.g. accelerate's offload): one
    that may be computed from its weight and bias directly."""
    hooked = module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook")
    return type(module) is nn.Linear and not hooked


def few_rows_linear_fn(weight: torch.Tensor, bias: Optional[torch.Tensor],
                       dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """``F.linear`` with `weight` and `bias`; for an fp32 CPU weight, up to DECODE_ROWS rows (decode,
    speculative verification) through kernels.cpu_gemv's fp32 kernel where it builds: it reads the
    weight once for up to 16 rows, where MKL's fp32 product of 2-5 rows costs 2-3x one row, and each
    row's result does not depend on the others (so a verification computes what decoding would). Its
    summation order is not MKL's: within ~1e-7 relative of ``F.linear``, not bit-equal
    (``QUANTKIT_CPU_DECODE_KERNEL=0``: ``F.linear`` threaded by output rows, bit-equal, at every size)."""
    from quantkit.runtime.backends import DECODE_ROWS, cpu_decode_kernel

    plain = linear_fn(weight, bias)
    cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32 and dtype == torch.float32
    kernel = cpu_decode_kernel() if cpu_fp32 else None
    if kernel is None:
        return plain
    few = kernel.prepare_f32(weight, bias)
    return lambda x2: few(x2) if x2.shape[0] <= DECODE_ROWS else plain(x2)


def norm_eps(module: nn.Module, default: float = 1e-6) -> float:
    for attr in ("variance_epsilon", "eps"):
        if hasattr(module, attr):
            return float(getattr(module, attr))
    return default


def norm_fn(module: nn.Module, kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A norm module as the functional call its forward makes (RMS: see :func:`rms_norm`)."""
    if kind == RMS:
        return functools.partial(rms_norm, weight=module.weight, eps=norm_eps(module))
    if kind == LAYER:
        return functools.partial(F.layer_norm, normalized_shape=module.normalized_shape, weight=module.weight,
                                 bias=module.bias, eps=module.eps)
    raise QuantkitError(f"unknown norm kind {kind!r}")


def activation_fn(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """F.silu / F.relu for the modules whose forward is just that (torch's, transformers'
    SiLUActivation), so the MLP can apply SiLU in place; any other activation module as it is."""
    if isinstance(module, nn.SiLU) or type(module).__name__ == "SiLUActivation":
        return F.silu
    if isinstance(module, nn.ReLU):
        return F.relu
    return module


@dataclass
class LayerPlan:
    """One decoder layer as the forward loop calls it."""
    norm_before: bool
    attn_norm: Callable
    mlp_norm: Callable
    qkv: Optional[Callable]  # fused q/k/v: [N, hidden] -> [N, (H + 2 KVH) D]; else q, k, v apart
    q: Optional[Callable]
    k: Optional[Callable]
    v: Optional[Callable]
    q_norm: Optional[Callable]  # per-head RMSNorm on q and k (Qwen3)
    k_norm: Optional[Callable]
    query_scale: Optional[float]  # OPT: q * head_dim^-0.5 after the projection
    o: Callable
    gate_up: Optional[Callable]  # gated MLP with a fused [gate | up] projection: [N, hidden] -> [N, 2 I]
    gate: Optional[Callable]  # gated MLP, apart
    up: Optional[Callable]  # gated: up; plain MLP: fc1
    down: Optional[Callable]
    act: Optional[Callable]
    gated: bool
    moe: Optional[Callable] = None  # a sparse layer's MoE block, [N, hidden] -> [N, hidden] (engine.moe)
    qk_norm_whole: bool = False  # q/k norms over the whole projection, before the heads split (OLMoE)
    latent: Optional[Callable] = None  # MLA: (h, rope) -> q, k, v per head (engine.latent_attention)


@dataclass
class DecoderModel:
    """Everything the runner's forward calls, from the embedding to the LM head."""
    layout: DecoderLayout
    embed: nn.Embedding
    project_in: Optional[Callable]
    positions: Optional[tuple[torch.Tensor, int]]  # learned position table and its offset (OPT)
    plans: list[LayerPlan]
    fused: list[tuple]  # per layer (fused q/k/v, fused gate/up) FusedProjections or None
    post: list[Callable]  # final norm, output projection (OPT's project_out): after the last layer
    lm_head: nn.Module
    head: Callable
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    attention_scale: Optional[float] = None  # None: head_dim^-0.5 (or 1 where the model scales q itself)
    value_dim: Optional[int] = None  # per-head channels o_proj reads, when the cache's head_dim is padded (MLA)

    @classmethod
    def build(cls, model: nn.Module, fuse_projections: bool, lm_head_quant: Optional[str] = None) -> "DecoderModel":
        """``lm_head_quant`` ("int8", "int4", "shortlist"): decode through a quantized copy of the head only
        (engine.quantized_head); the embedding, tied or not, is untouched."""
        adapter = get_adapter(model)
        layout = adapter.decoder_layout(model)
        cfg = model.config
        embed = resolve(model, layout.embed_tokens)
        dtype = embed.weight.dtype
        layers = list(adapter.decoder_layers(model))
        sparse = [bool(adapter.moe_blocks(layer)) for layer in layers]
        fused = [_fuse(layer, layout, s) if fuse_projections else (None, None) for layer, s in zip(layers, sparse)]
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        latent = layout.attention.latent
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        if latent is not None:  # K/V expanded per head, padded to one head_dim
            from quantkit.engine.latent_attention import cache_head_dim

            head_dim, num_kv_heads = cache_head_dim(latent), num_heads
        plans = [_plan(layer, layout, qkv, gate_up, dtype, head_dim, s)
                 for layer, (qkv, gate_up), s in zip(layers, fused, sparse)]
        post = [_post_fn(module, layout, dtype) for _, module in adapter.post_layers(model)]
        lm_head = adapter.lm_head(model)[1]
        positions = None
        if layout.position_embedding is not None:
            positions = (resolve(model, layout.position_embedding).weight, layout.position_offset)
        project_in = matmul_fn(resolve(model, layout.project_in), dtype) if layout.project_in else None
        head = matmul_fn(lm_head, dtype)
        if lm_head_quant is not None:
            from quantkit.engine.quantized_head import quantized_head_fn

            if not isinstance(lm_head, nn.Linear):
                raise QuantkitError(f"lm_head_quant needs a plain linear LM head, not {type(lm_head).__name__}")
            head = quantized_head_fn(lm_head.weight, lm_head.bias, lm_head_quant, dtype)
        return cls(layout, embed, project_in, positions, plans, fused, post, lm_head, head, num_heads, num_kv_heads,
                   head_dim, dtype, latent.scale if latent else None,
                   latent.v_dim if latent and latent.v_dim != head_dim else None)


def _post_fn(module: nn.Module, layout: DecoderLayout, dtype: torch.dtype) -> Callable:
    if isinstance(module, nn.Linear):
        return matmul_fn(module, dtype)
    return norm_fn(module, layout.norm)


def _fuse(layer: nn.Module, layout: DecoderLayout, sparse: bool) -> tuple:
    """q/k/v and gate/up of QuantLinear layers as one stacked matmul each (engine.fused), where the
    family keeps them apart (q/k normed over the whole projection, and MoE experts, stay apart)."""
    from quantkit.engine.fused import FusedProjection

    attn, mlp = layout.attention, layout.mlp
    apart = len(attn.qkv) == 3 and not attn.qk_norm_whole
    qkv = FusedProjection.build([resolve(layer, n) for n in attn.qkv]) if apart else None
    gate_up = None
    if mlp.kind == GATED and len(mlp.up) == 2 and not sparse:
        gate_up = FusedProjection.build([resolve(layer, n) for n in mlp.up])
    return qkv, gate_up


def _plan(layer: nn.Module, layout: DecoderLayout, fused_qkv, fused_gate_up, dt: torch.dtype,
          head_dim: int, sparse: bool = False) -> LayerPlan:
    """The layer's callables. The projections a fused one replaces are not resolved: a QuantLinear
    would build (pack) its own backend, a second copy of the fused weight the forward never calls."""
    attn = layout.attention
    if attn.latent is not None:
        return _latent_plan(layer, layout, dt, sparse)
    mm = functools.partial(_matmul_at, layer, dt)
    qkv = fused_qkv.matmul_fn(dt) if fused_qkv is not None else (mm(attn.qkv[0]) if len(attn.qkv) == 1 else None)
    apart = qkv is None
    qk_norm = [norm_fn(resolve(layer, n), RMS) if n else None for n in (attn.q_norm, attn.k_norm)]
    return LayerPlan(
        norm_before=layout.norm_before, attn_norm=norm_fn(resolve(layer, layout.attn_norm), layout.norm),
        mlp_norm=norm_fn(resolve(layer, layout.mlp_norm), layout.norm), qkv=qkv,
        q=mm(attn.qkv[0]) if apart else None, k=mm(attn.qkv[1]) if apart else None,
        v=mm(attn.qkv[2]) if apart else None, q_norm=qk_norm[0], k_norm=qk_norm[1],
        query_scale=head_dim ** -0.5 if attn.query_scaled else None, o=mm(attn.out),
        qk_norm_whole=attn.qk_norm_whole, **_mlp_fns(layer, layout, fused_gate_up, dt, sparse))


def _latent_plan(layer: nn.Module, layout: DecoderLayout, dt: torch.dtype, sparse: bool) -> LayerPlan:
    from quantkit.engine.latent_attention import LatentAttention

    mm = functools.partial(_matmul_at, layer, dt)
    latent = LatentAttention(layer, layout.attention.latent, resolve(layer, "self_attn").num_heads, mm, norm_fn)
    return LayerPlan(
        norm_before=layout.norm_before, attn_norm=norm_fn(resolve(layer, layout.attn_norm), layout.norm),
        mlp_norm=norm_fn(resolve(layer, layout.mlp_norm), layout.norm), qkv=None, q=None, k=None, v=None,
        q_norm=None, k_norm=None, query_scale=None, o=mm(layout.attention.out), latent=latent,
        **_mlp_fns(layer, layout, None, dt, sparse))


def _mlp_fns(layer: nn.Module, layout: DecoderLayout, fused_gate_up, dt: torch.dtype, sparse: bool) -> dict:
    """The MLP part of a LayerPlan: a sparse layer's MoE block (engine.moe), or the dense MLP's projections."""
    if sparse:
        from quantkit.engine.moe import moe_fn

        return dict(gate_up=None, gate=None, up=None, down=None, act=None, gated=False,
                    moe=moe_fn(layer, layout.moe, dt, matmul_fn, activation_fn))
    mlp = layout.mlp
    mm = functools.partial(_matmul_at, layer, dt)
    gated = mlp.kind == GATED
    gate_up = fused_gate_up.matmul_fn(dt) if fused_gate_up is not None else \
        (mm(mlp.up[0]) if gated and len(mlp.up) == 1 else None)
    gate_up_apart = gated and gate_up is None
    return dict(gate_up=gate_up, gate=mm(mlp.up[0]) if gate_up_apart else None,
                up=mm(mlp.up[1]) if gate_up_apart else (mm(mlp.up[0]) if not gated else None),
                down=mm(mlp.down), act=activation_fn(resolve(layer, mlp.act)), gated=gated)


def _matmul_at(layer: nn.Module, dtype: torch.dtype, name: str) -> Callable:
    return matmul_fn(resolve(layer, name), dtype)
