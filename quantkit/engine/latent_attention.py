"""DeepSeek's multi-head latent attention (MLA) as the paged cache holds it: per head K and V.

MLA stores one latent per token (kv_lora_rank + rope_dim numbers) and expands it per head with
kv_b_proj; vLLM's fast path keeps the latent in its cache and folds kv_b_proj into q and the output.
Here the latent is expanded once, when a token's K/V is written, so the engine's ordinary attention
(cache, kernels, prefix cache, rollback) runs MLA unchanged; the cost is cache size (H x head_dim per
token instead of the latent), acceptable for the models a CPU engine runs. The math is transformers'
``DeepseekV3Attention`` op for op:

    q = q_b(norm(q_a(h)))                       [N, H, nope + rope]   (or q_proj(h))
    c, k_rot = kv_a(h).split(kv_lora_rank, rope)
    k_nope, v = kv_b(norm(c)).split(nope, v)    [N, H, nope], [N, H, v]
    q_rot, k_rot rotated (interleaved pairs first de-interleaved: [x0 x2 ... | x1 x3 ...], as
    transformers' apply_rotary_pos_emb_interleave computes), k_rot shared by every head
    q = [q_nope | q_rot], k = [k_nope | k_rot], softmax scale from the layout (not head_dim^-0.5).

q, k and v are zero-padded to one head_dim, max(nope + rope, v): zeros add nothing to q.k and the
padded output channels are dropped before o_proj (``DecoderModel.value_dim``, in the runner's forward).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.models.base import resolve
from quantkit.models.layout import RMS, LatentAttentionLayout


def cache_head_dim(latent: LatentAttentionLayout) -> int:
    return max(latent.nope_dim + latent.rope_dim, latent.v_dim)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention:
    """One layer's MLA inputs: ``(h [N, hidden], rope) -> q, k, v [N, H, head_dim]`` for the paged cache."""

    def __init__(self, layer: nn.Module, latent: LatentAttentionLayout, num_heads: int,
                 matmul: Callable[[str], Callable], norm: Callable[[nn.Module, str], Callable]):
        self.latent, self.num_heads = latent, num_heads
        self.head_dim = cache_head_dim(latent)
        if len(latent.q) == 3:
            q_a, q_norm, q_b = matmul(latent.q[0]), norm(resolve(layer, latent.q[1]), RMS), matmul(latent.q[2])
            self.q = lambda h: q_b(q_norm(q_a(h)))
        else:
            self.q = matmul(latent.q[0])
        self.kv_a, self.kv_b = matmul(latent.kv_a), matmul(latent.kv_b)
        self.kv_a_norm = norm(resolve(layer, latent.kv_a_norm), RMS)

    def __call__(self, h: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lt, N, H = self.latent, h.shape[0], self.num_heads
        q = self.q(h).view(N, H, lt.nope_dim + lt.rope_dim)
        c, k_rot = self.kv_a(h).split([lt.kv_lora_rank, lt.rope_dim], dim=-1)
        k_nope, v = self.kv_b(self.kv_a_norm(c)).view(N, H, lt.nope_dim + lt.v_dim).split([lt.nope_dim, lt.v_dim], -1)
        q_nope, q_rot = q.split([lt.nope_dim, lt.rope_dim], dim=-1)
        k_rot = k_rot.view(N, 1, lt.rope_dim)
        if lt.interleaved:
            q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
        if rope is not None:
            rotate, cos, sin_signed = rope
            q_rot, k_rot = rotate(q_rot, cos, sin_signed), rotate(k_rot, cos, sin_signed)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(N, H, lt.rope_dim)), dim=-1)
        return self._pad(q), self._pad(k), self._pad(v)

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        short = self.head_dim - x.shape[-1]
        return F.pad(x, (0, short)) if short else x.contiguous()
