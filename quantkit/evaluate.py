"""Perplexity over non-overlapping windows of a held-out token stream.

Every window of `seq_len` tokens is scored independently (no context carried over), the
negative log-likelihoods of its `seq_len - 1` predicted tokens are summed over all windows, and
perplexity is exp(total NLL / predicted tokens): the same recipe for the original and the
quantized model, so their ratio is meaningful.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from quantkit.errors import QuantkitError


def windows_of(tokens: torch.Tensor, seq_len: int, max_windows: Optional[int] = None) -> torch.Tensor:
    n = tokens.numel() // seq_len
    if n == 0:
        raise QuantkitError(f"the evaluation text has {tokens.numel()} tokens, fewer than one window of {seq_len}; lower --seq-len")
    if max_windows is not None:
        n = min(n, max_windows)
    return tokens[: n * seq_len].reshape(n, seq_len)


@torch.no_grad()
def perplexity(model, tokens: torch.Tensor, seq_len: int = 512, max_windows: Optional[int] = None,
               batch_size: int = 4, progress: bool = False, logits_fn=None) -> dict:
    """Perplexity of `model` (a causal LM returning `.logits`, or `logits_fn(input_ids)`) over `tokens`."""
    windows = windows_of(tokens, seq_len, max_windows)
    device = next(model.parameters()).device if logits_fn is None else "cpu"
    total_nll = 0.0
    predicted = 0
    t0 = time.perf_counter()
    for start in tqdm(range(0, windows.shape[0], batch_size), desc="perplexity", disable=not progress):
        batch = windows[start:start + batch_size].to(device)
        logits = logits_fn(batch) if logits_fn is not None else model(input_ids=batch, use_cache=False).logits
        nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
        total_nll += nll.item()
        predicted += batch[:, 1:].numel()
    ppl = math.exp(total_nll / predicted)
    if not math.isfinite(ppl):
        raise QuantkitError("perplexity is not finite: the model produced NaN/inf logits")
    return {"perplexity": ppl, "tokens": int(predicted), "windows": int(windows.shape[0]),
            "seconds": time.perf_counter() - t0}
