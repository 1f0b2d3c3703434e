"""A sparse MoE block as the engine calls it: the router's top-k choice as each family computes it, then
each chosen expert on its tokens, weighted and summed, plus the shared expert.

Routing (``quantkit.models.layout.MoELayout.scoring``), as transformers 5.24's routers compute it:
- SOFTMAX (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): softmax over the router logits in fp32, top-k,
  the k weights divided by their sum when ``renormalize`` (Mixtral always; the Qwens and OLMoE
  when the config's norm_topk_prob is set).
- SIGMOID_GROUPED (DeepSeek-V3): s = sigmoid(logits) in fp32; the choice ranks s + the
  score-correction bias, only among the ``topk_group`` of ``n_group`` expert groups whose two best
  biased scores sum highest; the weights are the chosen s (not biased), divided by their sum
  (+1e-20) when ``renormalize``, times ``scaling`` (routed_scaling_factor).
Experts are per-expert linears (a loaded quantized model: each a QuantLinear, called through its
backend's direct entry) or transformers' fused 3-D weights, sliced per expert. The top-k weights
stay fp32 (as Mixtral and DeepSeek keep them; the Qwens and OLMoE round them to the model dtype
first, which in a bf16 model differs in the last bits).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.models.base import resolve
from quantkit.models.experts import RoutedExperts, check_fused, routed_tokens
from quantkit.models.layout import SIGMOID_GROUPED, SOFTMAX, MoELayout

Fn = Callable[[torch.Tensor], torch.Tensor]


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [N, k], expert ids [N, k])."""
    weights, index = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, index


def sigmoid_grouped_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int,
                         renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's group-limited routing (see the module docstring): (weights fp32 [N, k], ids [N, k])."""
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    n, e = choice.shape
    group_scores = choice.view(n, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
    allowed = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool().repeat_interleave(e // n_group, dim=1)
    index = torch.topk(choice.masked_fill(~allowed, float("-inf")), k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, index)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, index


def gated_fn(gate: Fn, up: Fn, down: Fn, act: Fn) -> Fn:
    def mlp(x: torch.Tensor) -> torch.Tensor:
        return down(act(gate(x)) * up(x))

    return mlp


def expert_fns(module: nn.Module, dtype: torch.dtype, matmul_fn, activation_fn) -> list[Fn]:
    """One callable per expert, [n, H] -> [n, H]: per-expert linears through `matmul_fn`, or slices of
    transformers' fused [E, 2I, H] / [E, H, I] weights (gate and up as one product, as its eager loop)."""
    if isinstance(module, RoutedExperts):
        return [gated_fn(matmul_fn(x.gate_proj, dtype), matmul_fn(x.up_proj, dtype), matmul_fn(x.down_proj, dtype),
                         activation_fn(x.act_fn)) for x in module]
    e, _, _ = check_fused(module)
    act = activation_fn(module.act_fn)

    def fused(k: int) -> Fn:
        gate_up, down = module.gate_up_proj[k], module.down_proj[k]

        def expert(x: torch.Tensor) -> torch.Tensor:
            gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
            return F.linear(act(gate) * up, down)

        return expert

    return [fused(k) for k in range(e)]


def moe_fn(layer: nn.Module, layout: MoELayout, dtype: torch.dtype, matmul_fn, activation_fn) -> Fn:
    """The layer's sparse block as one callable [N, H] -> [N, H]."""
    router = resolve(layer, layout.router).weight
    bias: Optional[torch.Tensor] = None
    if layout.score_bias is not None:
        owner, _, name = layout.score_bias.rpartition(".")
        bias = getattr(resolve(layer, owner), name)
    experts = expert_fns(resolve(layer, layout.experts), dtype, matmul_fn, activation_fn)
    shared = shared_gate = None
    if layout.shared is not None:
        s = resolve(layer, layout.shared)
        shared = gated_fn(matmul_fn(s.gate_proj, dtype), matmul_fn(s.up_proj, dtype), matmul_fn(s.down_proj, dtype),
                          activation_fn(s.act_fn))
    if layout.shared_gate is not None:
        shared_gate = matmul_fn(resolve(layer, layout.shared_gate), dtype)

    def route(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layout.scoring == SIGMOID_GROUPED:  # DeepSeek's router runs in fp32
            return sigmoid_grouped_topk(F.linear(h.float(), router.float()), bias, layout.top_k, layout.n_group,
                                        layout.topk_group, layout.renormalize, layout.scaling)
        assert layout.scoring == SOFTMAX, layout.scoring
        return softmax_topk(F.linear(h, router), layout.top_k, layout.renormalize)

    def block(h: torch.Tensor) -> torch.Tensor:
        weights, index = route(h)
        out = torch.zeros_like(h)
        for e, tokens, slots in routed_tokens(index, len(experts)):
            out.index_add_(0, tokens, (experts[e](h[tokens]) * weights[tokens, slots, None]).to(out.dtype))
        if shared is not None:
            extra = shared(h)
            out = out + (torch.sigmoid(shared_gate(h)) * extra if shared_gate is not None else extra)
        return out

    return block
