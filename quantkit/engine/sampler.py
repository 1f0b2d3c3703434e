"""Next-token selection for a batch: greedy, temperature, top-k, top-p, per-request seeds.

Order (the same as vLLM and transformers): divide by the temperature, keep the top-k logits, then
keep the smallest set of tokens whose probability (renormalised over the top-k) reaches top-p (the
most likely token is always kept), and draw from the softmax of what remains. All in fp32.
"""
from __future__ import annotations

from typing import Optional, Sequence as Seq

import torch

from quantkit.engine.sequence import SamplingParams


def top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Boolean [B, V]: True for tokens that must be dropped. ``top_k`` [B] int (<= 0: off),
    ``top_p`` [B] float (1.0: off)."""
    B, V = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=logits.device).expand(B, V)
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    drop_sorted = ranks >= k[:, None]
    masked = sorted_logits.masked_fill(drop_sorted, float("-inf"))
    probs = masked.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly ahead of each token
    drop_sorted |= (before >= top_p[:, None]) & (ranks > 0) & (top_p < 1.0)[:, None]
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def request_generator(seq, device: torch.device) -> Optional[torch.Generator]:
    """The request's own random stream (None: the global one), created on first use on ``device``."""
    seed = seq.sampling_params.seed
    if seed is None:
        return None
    if seq.generator is None or seq.generator.device != device:
        seq.generator = torch.Generator(device=device).manual_seed(int(seed))
    return seq.generator


def sampling_probs(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """The distribution each row is sampled from: softmax of logits [N, V] after the row's
    temperature, top-k and top-p (``params`` of sampling requests, one per row), fp32."""
    dev = logits.device
    sub = logits.float() / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    top_k = torch.tensor([p.top_k for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float32)
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        sub = sub.masked_fill(top_k_top_p_mask(sub, top_k, top_p), float("-inf"))
    return sub.softmax(dim=-1)


class Sampler:
    def __call__(self, logits: torch.Tensor, seqs: Seq) -> list[int]:
        """logits [B, V] (any float dtype) for ``seqs`` (objects with ``sampling_params``, ``generator``)."""
        logits = logits.float()
        params: list[SamplingParams] = [s.sampling_params for s in seqs]
        out = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            probs = sampling_probs(logits[torch.tensor(rows, device=logits.device)], [params[i] for i in rows])
            for j, i in enumerate(rows):
                gen = request_generator(seqs[i], logits.device)
                out[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        return out.tolist()
