"""The LM head alone quantized for decoding (``lm_head_quant``), from its weight at engine build.

Why: quantkit checkpoints keep ``lm_head`` in full precision (the default ``--ignore``), and on
a small model with a large vocabulary it is the biggest matmul of a decode step (the demo's 49k x
576 head: 113 MB in fp32, 57 MB in bf16, against ~56 MB for all 30 int4 decoder layers together). Quantizing only the
head's copy here never touches the embedding, even when the two are tied, and never changes the
checkpoint. It changes the logits: ``scripts/bench_decode.py --lm-head-quant`` measures top-1
agreement and KL against the unquantized head.

* ``"int8"``: symmetric, one scale per output row (vocabulary entry), the packed int8 kernel.
* ``"int4"``: symmetric, one scale per 64 inputs of a row, the packed int4 kernel.
* ``"shortlist"``: the int4 head picks SHORTLIST candidates per row, whose logits are then computed
  exactly from the unquantized head; every other logit is -inf. The int4 head alone is a poor
  head (KL 0.16-0.23 to the fp32 one, top-1 0.70-0.73 on held-out Lee / wiki text), but the fp32
  argmax is among its top 64 for 100 % of 4,096 held-out tokens of each (99.93 % among its top 32),
  so greedy tokens are the unquantized head's at the int4 head's cost plus 64 rows. Sampling draws
  from the shortlist (top-64 sampling): right for a speculative draft, whose rejection sampling keeps
  the target's distribution whatever the draft's; a changed distribution for a target.

RTN is enough: a head row's argmax is what matters, and both kernels compute in bf16.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from quantkit.errors import QuantkitError

MODES = {"int8": (8, -1), "int4": (4, 64), "shortlist": (4, 64)}  # bits, group size
SHORTLIST = 64


def quantized_head_fn(weight: torch.Tensor, bias: Optional[torch.Tensor], mode: str,
                      dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x [M, hidden] -> logits [M, vocab]`` in `dtype` through an RTN copy of the head `weight`."""
    from quantkit.quantizers.grid import rtn_quantize
    from quantkit.runtime import backends

    if mode not in MODES:
        raise QuantkitError(f"lm_head_quant must be one of {', '.join(MODES)}, got {mode!r}")
    bits, group = MODES[mode]
    out_features, in_features = weight.shape
    if group != -1 and in_features % group:
        group = -1  # a width the groups do not divide: one scale per row
    qw = rtn_quantize(weight.detach().float().cpu(), bits, group, True)
    device = weight.device
    impl = backends.build(backends.resolve("auto", device), qw, device)
    quantized = backends.matmul_fn(impl, dtype, None if bias is None else bias.detach())
    if mode != "shortlist":
        return quantized
    return shortlist_head_fn(quantized, weight, bias, min(SHORTLIST, out_features))


def shortlist_head_fn(approx: Callable[[torch.Tensor], torch.Tensor], weight: torch.Tensor,
                      bias: Optional[torch.Tensor], k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> logits``: `approx`'s top `k` entries per row recomputed exactly (``x @ weight[i]``, +
    bias) in the head's own dtype and fp32 accumulation, every other entry -inf."""
    def head(x: torch.Tensor) -> torch.Tensor:
        rough = approx(x)
        idx = rough.topk(k, dim=-1).indices  # [M, k]
        rows = weight.detach()[idx]  # [M, k, hidden]
        exact = torch.einsum("mkh,mh->mk", rows.float(), x.float())
        if bias is not None:
            exact = exact + bias.detach().float()[idx]
        out = torch.full_like(rough, float("-inf"))
        return out.scatter_(-1, idx, exact.to(out.dtype))
    return head
