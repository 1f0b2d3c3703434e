"""The engine's CPU decode step in one C call (kernels.cpu_decoder), for the models it covers.

Why: a batch-1 CPU decode step of a small quantized model spends as long in PyTorch dispatch around
its projections (norms, rotary, K/V writes, attention, residuals: ~15 calls per layer) as in the
projections; the C step runs every layer on the same int4/int8 decode kernels without that.

It serves a step of up to DECODE_ROWS tokens (decode, speculative verification, a draft catching
up) when everything it computes is what the Python layer loop would: CPU, fp32 activations, an fp32
(unquantized) KV cache, pre-norm RMSNorm layers (and Qwen3's per-head q/k norms), full rotary, plain
softmax attention, a SiLU-gated
MLP, and every projection on a cpu_gemv kernel (4-bit groups of 32k or per-channel int8 without
act-order permutation, or an unquantized fp32 nn.Linear). Anything else keeps the Python loop, which
is also this step's reference (tests/test_c_decode_step.py). ``QUANTKIT_CPU_DECODE_STEP=0``
switches it off; ``QUANTKIT_CPU_DECODE_KERNEL=0`` switches off the kernels under it too.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F

from quantkit.engine.decoder import is_plain_linear, norm_eps
from quantkit.models import get_adapter
from quantkit.models.base import resolve
from quantkit.models.layout import GATED, RMS

ENV_SWITCH = "QUANTKIT_CPU_DECODE_STEP"


@functools.lru_cache(maxsize=None)
def _kernel():
    from quantkit.assets import cache_dir
    from quantkit.kernels.cpu_decoder import CpuDecoderKernel

    return CpuDecoderKernel(cache_dir() / "cpu-kernels")


def _projection(source) -> Optional[tuple[object, Optional[torch.Tensor]]]:
    """(cpu_gemv kernel, bias added after it) of a FusedProjection, a QuantLinear or a plain fp32
    nn.Linear (whose kernel carries its bias); None when it has no kernel."""
    from quantkit.engine.fused import FusedProjection
    from quantkit.runtime import backends
    from quantkit.runtime.quant_linear import QuantLinear

    if isinstance(source, FusedProjection):
        gemv = getattr(source.impl, "decode_gemv", None)
        return None if gemv is None else (gemv, source.bias)
    if isinstance(source, QuantLinear) and source.spec.input_quant is None:
        gemv = getattr(source.backend_impl(), "decode_gemv", None)
        return None if gemv is None else (gemv, source.bias)
    kernel = backends.cpu_decode_kernel()
    if is_plain_linear(source) and source.weight.dtype == torch.float32 and kernel is not None:
        return kernel.prepare_f32(source.weight, source.bias), None
    return None


def build(model, decoder, kv_cache, block_size: int, attn_scale: float, rotary) -> tuple[Optional[object], str]:
    """(kernels.cpu_decoder.DecoderStack over this model's layers and cache, "") or (None, why not)."""
    from quantkit.kernels.cpu_decoder import LayerWeights

    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None, f"{ENV_SWITCH}=0"
    layout = decoder.layout
    attn, mlp = layout.attention, layout.mlp
    if decoder.embed.weight.device.type != "cpu" or decoder.dtype != torch.float32:
        return None, "needs fp32 activations on the CPU"
    if kv_cache.dtype != torch.float32 or kv_cache.quantized:
        return None, "needs an fp32 KV cache"
    if layout.norm != RMS or not layout.norm_before or rotary is None or rotary.partial:
        return None, "needs pre-norm RMSNorm layers with full rotary"
    if decoder.positions is not None or decoder.project_in is not None or decoder.value_dim is not None:
        return None, "needs token embeddings straight into the layers"
    if attn.latent is not None or attn.qk_norm_whole or attn.query_scaled:
        return None, "needs plain multi-head attention (no latent attention, whole-projection q/k norms or scaled q)"
    if mlp.kind != GATED or any(p.moe is not None or p.act is not F.silu for p in decoder.plans):
        return None, "needs dense SiLU-gated MLPs"
    layers = list(get_adapter(model).decoder_layers(model))
    weights, eps = [], set()
    for i, (layer, (qkv, gate_up)) in enumerate(zip(layers, decoder.fused)):
        sources = {"qkv": [qkv] if qkv is not None else [resolve(layer, n) for n in attn.qkv],
                   "o": [resolve(layer, attn.out)],
                   "gate_up": [gate_up] if gate_up is not None else [resolve(layer, n) for n in mlp.up],
                   "down": [resolve(layer, mlp.down)]}
        projections = {name: [_projection(src) for src in srcs] for name, srcs in sources.items()}
        missing = [name for name, parts in projections.items() if any(p is None for p in parts)]
        if missing:
            return None, (f"layer {i}'s {missing[0]} projection has no decode kernel (needs 4-bit, per-channel "
                          "8-bit or fp32 linears)")
        norms = [resolve(layer, n) for n in (layout.attn_norm, layout.mlp_norm)]
        head_norms = [resolve(layer, n) for n in (attn.q_norm, attn.k_norm) if n]  # Qwen3: per head
        eps |= {norm_eps(n) for n in norms + head_norms}
        weights.append(LayerWeights(norms[0].weight, norms[1].weight, qkv=projections["qkv"],
                                    o=projections["o"][0], gate_up=projections["gate_up"],
                                    down=projections["down"][0],
                                    q_norm=head_norms[0].weight if head_norms else None,
                                    k_norm=head_norms[1].weight if head_norms else None))
    if len(eps) != 1:
        return None, "needs one RMSNorm epsilon for every layer"
    kernel = _kernel()
    if kernel.problem is not None:
        return None, kernel.problem
    caches = [kv_cache.layer(i)[:2] for i in range(len(weights))]
    stack = kernel.stack(weights, caches, decoder.num_heads, decoder.num_kv_heads, decoder.head_dim, block_size,
                         eps.pop(), attn_scale)
    return stack, ""

