"""Speculative decoding's acceptance rule: which draft tokens the target keeps, and what follows them.

Standard rejection sampling (Leviathan et al. 2023; Chen et al. 2023). The draft proposed token
``x_j`` from its distribution ``q_j``; the target's distribution at the same position is ``p_j``
(both after the request's temperature / top-k / top-p). Going left to right, ``x_j`` is accepted
with probability ``min(1, p_j(x_j) / q_j(x_j))``; the first rejected one is replaced by a draw from
the residual ``norm(max(0, p_j - q_j))`` and the step ends; when every draft token is accepted one
more token is drawn from the target's distribution after the last. Each emitted token is then
distributed exactly as the target alone would have drawn it, whatever the draft.

A draft without a distribution (n-gram lookup) proposes deterministically: ``q_j`` is one-hot, so
``x_j`` is kept with probability ``p_j(x_j)`` and the residual is ``p_j`` with ``x_j`` removed.
Greedy requests are the limit of the same rule (``p_j`` one-hot at the argmax): keep draft tokens
while they equal the target's argmax, then emit the argmax (:func:`accept_greedy`).
"""
from __future__ import annotations

from typing import Optional

import torch


def accept_greedy(target_argmax: list[int], draft: list[int]) -> list[int]:
    """Tokens a greedy request emits: the draft's leading run that matches the target's argmax at
    each position (``target_argmax`` has one more entry than ``draft``), then the target's own token."""
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return draft[:n] + [target_argmax[n]]


def keeps(uniforms: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """Whether each draft token is kept: ``u < min(1, p(x) / q(x))`` for ``u`` uniform in [0, 1),
    written ``u * q(x) < p(x)`` (no division; q(x) > 0 for a token the draft drew)."""
    return uniforms * q_x < p_x


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` row by row: where the target puts more mass than the draft. A row with
    none left (p == q up to rounding, where a rejection has probability ~0) falls back to ``p``."""
    r = (p - q).clamp_(min=0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


def rejection_sample(target_probs: torch.Tensor, draft_probs: Optional[torch.Tensor], draft_tokens: torch.Tensor,
                     num_drafts: torch.Tensor, uniforms: torch.Tensor,
                     generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of independent requests, K draft slots each (row b uses the first ``num_drafts[b]``).

    target_probs [B, K + 1, V], draft_probs [B, K, V] (None: one-hot drafts), draft_tokens [B, K]
    long, num_drafts [B] long, uniforms [B, K] in [0, 1). Returns (accepted count [B], the token
    emitted after the accepted ones [B]): a row emits ``draft_tokens[b, :count] + [token]``."""
    B, K = draft_tokens.shape
    rows = torch.arange(B, device=target_probs.device)
    if K:
        idx = draft_tokens.unsqueeze(-1)
        p_x = target_probs[:, :K].gather(-1, idx).squeeze(-1)
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, idx).squeeze(-1)
        valid = torch.arange(K, device=target_probs.device)[None, :] < num_drafts[:, None]
        accepted = keeps(uniforms, p_x, q_x) & valid
        count = accepted.int().cumprod(dim=-1).sum(dim=-1)
    else:
        count = torch.zeros(B, dtype=torch.long, device=target_probs.device)
    p_next = target_probs[rows, count]
    rejected = count < num_drafts
    if bool(rejected.any()):
        at = count.clamp(max=max(K - 1, 0))
        if draft_probs is None:
            q_next = torch.zeros_like(p_next).scatter_(-1, draft_tokens[rows, at].unsqueeze(-1), 1.0)
        else:
            q_next = draft_probs[rows, at]
        p_next = torch.where(rejected[:, None], residual(p_next, q_next), p_next)
    token = torch.multinomial(p_next, 1, generator=generator).squeeze(-1)
    return count, token
