"""Held-out scoring: perplexity, and how far a model's next-token distribution moved from a baseline's.

Every window of `seq_len` tokens is scored on its own (no context carried over); the `seq_len - 1`
positions that predict a next token are the scored tokens of that window.

- Perplexity: exp(total NLL / scored tokens), the same recipe for every model.
- KL divergence to a baseline, per scored token: KL(P_base || P_model) = sum_v p_base(v) (log p_base(v) -
  log p_model(v)), reported as its mean and 99th percentile, with top-1 agreement (the share of tokens whose
  most likely next token is the same). This is llama.cpp's `perplexity --kl-divergence` measure: paired token
  by token, it sees differences that perplexity over the same text hides in its run-to-run noise.
- How sure those means are: the standard error of the mean KL and of ln(PPL(model) / PPL(baseline)) (the
  mean per-token NLL difference, paired), over windows. The windows are the independent units: tokens of
  one window share their context, so a per-token error (llama.cpp's) would claim more certainty than the
  text holds. Two models scored on the same windows differ by more than noise in these terms only when
  their difference is several of these errors.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from quantkit.errors import QuantkitError

# rows of [tokens, vocab] log-probabilities held at once while comparing with the baseline
COMPARE_ROWS = 1024


def context_length(config) -> Optional[int]:
    """The longest sequence a model was built for (its config's max_position_embeddings; a dict of
    config.json or a transformers config), None when it names none."""
    n = config.get("max_position_embeddings") if isinstance(config, dict) else getattr(config, "max_position_embeddings", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def check_seq_len(seq_len: int, config, model_name: str) -> None:
    """Windows longer than the model's context are scored past the positions it was trained on
    (garbage logits, or an index error for learned positions): refuse them, naming the limit."""
    limit = context_length(config)
    if limit is not None and seq_len > limit:
        raise QuantkitError(f"--seq-len {seq_len} exceeds the context of {model_name} ({limit} tokens, "
                            f"max_position_embeddings); pass --seq-len {limit} or less")


def windows_of(tokens: torch.Tensor, seq_len: int, max_windows: Optional[int] = None) -> torch.Tensor:
    """The first `max_windows` non-overlapping windows of `seq_len` tokens, as [n, seq_len]."""
    n = tokens.numel() // seq_len
    if n == 0:
        raise QuantkitError(f"the evaluation text has {tokens.numel()} tokens, fewer than one window of {seq_len}; lower --seq-len")
    if max_windows is not None:
        n = min(n, max_windows)
    return tokens[: n * seq_len].reshape(n, seq_len)


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def logits_of(model, logits_fn: Optional[Callable] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """input_ids [B, T] -> logits [B, T, V]: `logits_fn` when given (the engine), else the model's forward."""
    if logits_fn is not None:
        return logits_fn
    return lambda ids: model(input_ids=ids.to(model_device(model)), use_cache=False).logits


def batches(windows: torch.Tensor, batch_size: int, progress: bool, desc: str) -> Iterator[tuple[int, torch.Tensor]]:
    for start in tqdm(range(0, windows.shape[0], batch_size), desc=desc, disable=not progress):
        yield start, windows[start:start + batch_size]


@torch.no_grad()
def perplexity(model, tokens: torch.Tensor, seq_len: int = 512, max_windows: Optional[int] = None,
               batch_size: int = 4, progress: bool = False, logits_fn=None) -> dict:
    """Perplexity of `model` (a causal LM returning `.logits`, or `logits_fn(input_ids)`) over `tokens`."""
    windows = windows_of(tokens, seq_len, max_windows)
    forward = logits_of(model, logits_fn)
    total_nll, t0 = 0.0, time.perf_counter()
    for _, batch in batches(windows, batch_size, progress, "perplexity"):
        logits = forward(batch)
        total_nll += next_token_nll(logits, batch).item()
    predicted = windows.shape[0] * (seq_len - 1)
    return {"perplexity": finite_perplexity(total_nll, predicted), "tokens": int(predicted),
            "windows": int(windows.shape[0]), "seconds": time.perf_counter() - t0}


def next_token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed NLL of each window's next tokens (positions 0..T-2 predict 1..T-1)."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1).to(logits.device),
                           reduction="sum")


def finite_perplexity(total_nll: float, predicted: int) -> float:
    ppl = math.exp(total_nll / predicted)
    if not math.isfinite(ppl):
        raise QuantkitError("perplexity is not finite: the model produced NaN/inf logits")
    return ppl


@dataclass
class Comparison:
    """Running totals of a model scored against a baseline, window batch by window batch."""

    nll: float = 0.0
    baseline_nll: float = 0.0
    agree: int = 0
    kl: list = field(default_factory=list)  # per-token KL values, one tensor per chunk
    nll_gap: list = field(default_factory=list)  # per-token NLL(model) - NLL(baseline), one tensor per chunk

    def add(self, lp_model: torch.Tensor, lp_base: torch.Tensor, targets: torch.Tensor) -> None:
        """One chunk of scored tokens: log-probabilities [rows, V] of both models and the true next tokens."""
        self.kl.append((lp_base.exp() * (lp_base - lp_model)).sum(-1).cpu())
        self.agree += int((lp_model.argmax(-1) == lp_base.argmax(-1)).sum())
        nll_model, nll_base = -lp_model.gather(1, targets[:, None]), -lp_base.gather(1, targets[:, None])
        self.nll += float(nll_model.sum())
        self.baseline_nll += float(nll_base.sum())
        self.nll_gap.append((nll_model - nll_base).squeeze(1).double().cpu())

    def summary(self, window_tokens: int) -> dict:
        """The totals; standard errors over windows of `window_tokens` scored tokens (the chunks' order)."""
        kl = torch.cat(self.kl).double()
        n = kl.numel()
        kl_w, gap_w = window_means(kl, window_tokens), window_means(torch.cat(self.nll_gap), window_tokens)
        return {"perplexity": finite_perplexity(self.nll, n), "baseline_perplexity": finite_perplexity(self.baseline_nll, n),
                "kl_mean": float(kl.mean()), "kl_p99": float(torch.quantile(kl, 0.99)),
                "kl_mean_stderr": stderr(kl_w), "ln_ppl_ratio": float(gap_w.mean()), "ln_ppl_ratio_stderr": stderr(gap_w),
                "top1_agreement": self.agree / n, "tokens": n,
                # per window, for paired comparisons of two models scored on the same windows
                "window_kl": kl_w.tolist(), "window_ln_ppl_ratio": gap_w.tolist()}


def window_means(values: torch.Tensor, window_tokens: int) -> torch.Tensor:
    """Per-token `values` of whole windows (in order) -> one mean per window."""
    if values.numel() % window_tokens:
        raise ValueError(f"{values.numel()} scored tokens are not whole windows of {window_tokens}")
    return values.double().reshape(-1, window_tokens).mean(1)


def stderr(window_values) -> Optional[float]:
    """Standard error of the mean over windows: their spread / sqrt(windows). None for a single window.
    For a paired comparison pass the per-window differences of two models."""
    v = torch.as_tensor(window_values, dtype=torch.float64)
    if v.numel() < 2:
        return None
    return float(v.std(unbiased=True) / math.sqrt(v.numel()))


@torch.no_grad()
def compare(model_logits: Callable[[torch.Tensor], torch.Tensor], baseline_logits: Callable[[int, torch.Tensor], torch.Tensor],
            windows: torch.Tensor, batch_size: int = 4, progress: bool = False) -> dict:
    """Perplexity of both models and the KL / top-1 statistics of the model against the baseline.

    `baseline_logits(start, ids)` gives the baseline's logits for the windows `start:start+len(ids)`
    (from its cache or its forward); both are compared in fp32, COMPARE_ROWS tokens at a time."""
    acc = Comparison()
    for start, batch in batches(windows, batch_size, progress, "kl divergence"):
        ours = model_logits(batch)[:, :-1]
        base = baseline_logits(start, batch)[:, :-1]
        targets = batch[:, 1:].reshape(-1)
        ours, base = ours.reshape(-1, ours.shape[-1]), base.reshape(-1, base.shape[-1])
        if ours.shape != base.shape:
            raise QuantkitError(f"the model and the baseline disagree on the vocabulary ({ours.shape[-1]} vs "
                                f"{base.shape[-1]} logits); compare models that share a tokenizer")
        for row in range(0, ours.shape[0], COMPARE_ROWS):
            part = slice(row, row + COMPARE_ROWS)
            acc.add(F.log_softmax(ours[part].float(), -1), F.log_softmax(base[part].float().to(ours.device), -1),
                    targets[part].to(ours.device))
    return acc.summary(windows.shape[1] - 1)
