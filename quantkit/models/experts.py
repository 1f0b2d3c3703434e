"""Routed experts as one `nn.Linear` per projection, computing what transformers' fused experts compute.

transformers 5 keeps a MoE layer's routed experts as one module with two 3-D parameters,
``gate_up_proj`` [E, 2I, H] (rows :I gate, I: up) and ``down_proj`` [E, H, I], and runs them with a
grouped GEMM, so no per-expert linear is ever called: hooks cannot see an expert's tokens and
nothing that looks for ``nn.Linear`` finds the experts. `RoutedExperts` holds the same weights as
``experts.{e}.gate_proj/up_proj/down_proj`` linears (the names checkpoints and vLLM use) and has the
fused module's forward signature ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``:
each expert runs on exactly the tokens routed to it, its output weighted and summed as
transformers' eager loop does. The calibration pipeline swaps it in for one decoder layer at a
time (`from_fused`, then `write_into` puts the results back); the loader builds the quantized
model with it, each linear then a `QuantLinear`.

`route_all_tokens` (calibration only, llm-compressor's "calibrate all experts"): every expert also
runs on every token, so observers see all tokens, while the output still sums only the routed
ones: the block's output is the routed one.
"""
from __future__ import annotations

import torch
from torch import nn

from quantkit.errors import QuantkitError

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class ExpertMLP(nn.Module):
    """One expert: down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, act_fn: nn.Module, device=None, dtype=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, device=device, dtype=dtype)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def check_fused(fused: nn.Module) -> tuple[int, int, int]:
    """(E, H, I) of a transformers fused experts module of the plain form `RoutedExperts` reproduces:
    concatenated [gate; up] rows, not transposed, no biases, no post-expert norm (gpt-oss's
    interleaved, biased, clamped experts are another form)."""
    gate_up, down = getattr(fused, "gate_up_proj", None), getattr(fused, "down_proj", None)
    plain = (getattr(fused, "has_gate", True) and not getattr(fused, "has_bias", False)
             and not getattr(fused, "is_transposed", False) and getattr(fused, "is_concatenated", True)
             and not getattr(fused, "has_post_expert_norm", False) and hasattr(fused, "act_fn"))
    if not plain or not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) \
            or gate_up.dim() != 3 or down.dim() != 3:
        raise QuantkitError(f"{type(fused).__name__} is not a fused experts module of the form quantkit knows "
                            "(gate_up_proj [E, 2I, H], down_proj [E, H, I], no biases); unsupported layout")
    e, two_i, h = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        raise QuantkitError(f"{type(fused).__name__}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                            f"{tuple(down.shape)} do not describe [E, 2I, H] / [E, H, I]; unsupported layout")
    return e, h, two_i // 2


class RoutedExperts(nn.ModuleList):
    """Per-expert linears with the fused experts module's forward (see the module docstring). A
    ModuleList, so its linears are named ``experts.{e}.gate_proj`` as in checkpoints."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act_fn: nn.Module, device=None, dtype=None):
        super().__init__(ExpertMLP(hidden, intermediate, act_fn, device, dtype) for _ in range(num_experts))
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden, intermediate
        self.route_all_tokens = False

    @classmethod
    def from_fused(cls, fused: nn.Module) -> "RoutedExperts":
        """Per-expert linears viewing `fused`'s parameters (no copy until a weight is replaced)."""
        check_fused(fused)
        return cls.viewing(fused.gate_up_proj, fused.down_proj, fused.act_fn)

    @classmethod
    def viewing(cls, gate_up: torch.Tensor, down: torch.Tensor, act_fn: nn.Module) -> "RoutedExperts":
        """Per-expert linears viewing tensors in the fused layout `check_fused` accepts (gate_up [E, 2I, H],
        down [E, H, I]): copying into an expert's weight fills its rows there (the streamed reader fuses so)."""
        e, two_i, h = gate_up.shape
        i = two_i // 2
        routed = cls(e, h, i, act_fn, device="meta", dtype=gate_up.dtype)
        for k, expert in enumerate(routed):
            expert.gate_proj.weight = nn.Parameter(gate_up.data[k, :i], requires_grad=False)
            expert.up_proj.weight = nn.Parameter(gate_up.data[k, i:], requires_grad=False)
            expert.down_proj.weight = nn.Parameter(down.data[k], requires_grad=False)
        return routed

    @torch.no_grad()
    def write_into(self, fused: nn.Module) -> None:
        """Copy each expert's (fake-quantized) weights back into the fused parameters."""
        gate_up, down = fused.gate_up_proj.data, fused.down_proj.data
        i = self.intermediate_dim
        for k, expert in enumerate(self):
            for target, linear in ((gate_up[k, :i], expert.gate_proj), (gate_up[k, i:], expert.up_proj),
                                   (down[k], expert.down_proj)):
                w = linear.weight.data
                if w.data_ptr() != target.data_ptr():
                    target.copy_(w.to(device=target.device, dtype=target.dtype))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        routes = {e: (token_idx, pos) for e, token_idx, pos in routed_tokens(top_k_index, self.num_experts)}
        for e in range(self.num_experts) if self.route_all_tokens else routes:
            token_idx, top_k_pos = routes.get(e, (None, None))
            if self.route_all_tokens:  # every token through the expert, only the routed rows kept
                y = self[e](hidden_states)
                if token_idx is None:
                    continue
                y = y[token_idx]
            else:
                y = self[e](hidden_states[token_idx])
            out.index_add_(0, token_idx, (y * top_k_weights[token_idx, top_k_pos, None]).to(out.dtype))
        return out


def routed_tokens(top_k_index: torch.Tensor, num_experts: int):
    """(expert, token indices, their top-k slots) for every expert at least one token chose, in expert
    order; within an expert slot-major, then by token, the order of transformers' eager loop."""
    t = top_k_index.shape[0]
    slot_major = top_k_index.t().reshape(-1)  # index = slot * T + token
    order = torch.argsort(slot_major, stable=True)
    counts = torch.bincount(slot_major, minlength=num_experts).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n:
            picks = order[start:start + n]
            start += n
            yield e, picks % t, picks // t
