"""Fused input projections for the engine: q/k/v as one matmul, gate/up as one.

Why: on CPU a batch-1 decode step is a few hundred tiny packed-int4 matmuls whose fixed cost
(thread wake-up, unpacking set-up) rivals their arithmetic; linears that read the same input
can run as one wider matmul. GPTQ/AWQ/RTN quantize each output row independently, so stacking
the rows of q, k and v (codes, scales, zeros, bias) is exactly the same quantized weight, split
back by columns of the output.

Only QuantLinear layers are fused, and only when their schemes agree (same bits, group size,
symmetry and group index): a plain nn.Linear model keeps transformers' exact per-module matmuls,
so with the CPU decode kernels off (``QUANTKIT_CPU_DECODE_KERNEL=0``) the engine's greedy tokens still
match ``generate`` bit for bit.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from quantkit.qtensor import QuantizedWeight
from quantkit.runtime import backends
from quantkit.runtime.quant_linear import QuantLinear


def stack_rows(weights: list[QuantizedWeight]) -> Optional[QuantizedWeight]:
    """One QuantizedWeight holding the rows of all `weights`, or None when they cannot share one."""
    first = weights[0]
    for qw in weights[1:]:
        if (qw.bits, qw.group_size, qw.sym, qw.act_order, qw.input_quant) != \
                (first.bits, first.group_size, first.sym, first.act_order, first.input_quant) \
                or not torch.equal(qw.g_idx, first.g_idx) or qw.qweight.shape[1] != first.qweight.shape[1]:
            return None
    biases = [qw.bias for qw in weights]
    if any(b is not None for b in biases):
        biases = [b if b is not None else torch.zeros(qw.qweight.shape[0]) for b, qw in zip(biases, weights)]
        bias = torch.cat([b.float() for b in biases])
    else:
        bias = None
    return QuantizedWeight(qweight=torch.cat([qw.qweight for qw in weights]),
                           scales=torch.cat([qw.scales for qw in weights]),
                           zeros=torch.cat([qw.zeros for qw in weights]), g_idx=first.g_idx, bits=first.bits,
                           group_size=first.group_size, sym=first.sym, bias=bias, act_order=first.act_order,
                           input_quant=first.input_quant)


class FusedProjection:
    """Several QuantLinears reading one input, run as one backend matmul whose output holds theirs
    side by side (one tensor, so the engine can rotate q and k together)."""

    def __init__(self, impl, bias: Optional[torch.Tensor]):
        self.impl, self.bias = impl, bias

    @classmethod
    def build(cls, modules: list[nn.Module]) -> Optional["FusedProjection"]:
        if len(modules) < 2 or not all(isinstance(m, QuantLinear) for m in modules):
            return None
        if not all(m.spec.input_quant is None for m in modules):
            return None  # W8A8 quantizes activations per module: keep it per module
        stacked = stack_rows([m.quantized_weight() for m in modules])
        if stacked is None:
            return None
        device = next(iter(modules[0].packed_tensors().values())).device
        name = backends.resolve(modules[0].backend, device)
        try:
            impl = backends.build(name, stacked, device)
        except Exception:  # a backend that refuses the stacked shape: stay unfused
            return None
        bias = None if stacked.bias is None else stacked.bias.to(device)
        return cls(impl, bias)

    def matmul_fn(self, dtype: torch.dtype):
        """The fused matmul (bias included) as a plain callable on 2-D activations in `dtype`, [N, in] ->
        [N, sum of the modules' out_features] (see ``QuantLinear.matmul_fn``)."""
        return backends.matmul_fn(self.impl, dtype, self.bias)
