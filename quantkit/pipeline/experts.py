"""MoE layers while they are calibrated: per-expert linears, tokens per expert, and the few-token policy.

For the time one decoder layer is calibrated, each of its fused experts modules (transformers'
3-D ``gate_up_proj``/``down_proj``) is swapped for `RoutedExperts`, per-expert ``nn.Linear``s that
view the same weights and route each token exactly as transformers does, so the recipe's steps see
every expert's own tokens through ordinary hooks and quantize each expert like any linear. When the
layer is done, the (fake-quantized) per-expert weights are copied back into the fused parameters
and the fused module is put back: the user's model keeps its own structure.

How experts are calibrated (`ExpertPolicy`):
- ``routed``: each expert sees the tokens the router sends it. An expert that received fewer than
  ``min_tokens`` in the pass that calibrates it is quantized without calibration by the recipe's
  weight quantizer (`quantize_uncalibrated`: round to nearest), never from an empty Hessian
  (which the dead-column rule would turn into an all-zero expert).
- ``all``: every token also runs through every expert, so every expert is calibrated on all of
  them, while the block's output still sums only the routed experts (llm-compressor's default).

Counts are plain int64 tensors per block, accumulated batch by batch (a data-parallel run can
all-reduce them); `stats` turns them into what the progress record, the model card and
``quantize --json`` show.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.models.base import MoEBlock, resolve
from quantkit.models.experts import RoutedExperts

MODES = ("routed", "all")
DEFAULT_MODE = "routed"
DEFAULT_MIN_TOKENS = 8


@dataclass(frozen=True)
class ExpertPolicy:
    mode: str = DEFAULT_MODE
    min_tokens: int = DEFAULT_MIN_TOKENS  # routed: fewer calibration tokens than this -> uncalibrated (RTN)

    def __post_init__(self):
        if self.mode not in MODES:
            raise QuantkitError(f"--moe-calibration must be one of {', '.join(MODES)}, got {self.mode!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 1:
            raise QuantkitError(f"--moe-min-tokens must be a positive integer, got {self.min_tokens!r}")


class BlockExperts:
    """One MoE block of the layer: its fused module, the per-expert stand-in and their counts."""

    def __init__(self, layer: nn.Module, block: MoEBlock, route_all: bool):
        self.block = block
        parent_name, _, self.child = block.experts.rpartition(".")
        self.parent = resolve(layer, parent_name) if parent_name else layer
        self.fused = getattr(self.parent, self.child)
        self.routed = RoutedExperts.from_fused(self.fused)
        self.routed.route_all_tokens = route_all
        self.routed_tokens = torch.zeros(block.num_experts, dtype=torch.int64)  # natural routing
        self.tokens = 0  # tokens that reached the block
        self.counting = False
        self.handle = self.routed.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        if self.counting:
            top_k_index = args[1]
            self.routed_tokens += torch.bincount(top_k_index.reshape(-1).cpu(), minlength=self.block.num_experts)
            self.tokens += int(top_k_index.shape[0])

    def swap_in(self) -> None:
        setattr(self.parent, self.child, self.routed)

    def swap_out(self) -> None:
        self.handle.remove()
        self.routed.write_into(self.fused)
        setattr(self.parent, self.child, self.fused)

    def calibration_tokens(self) -> torch.Tensor:
        """Tokens each expert is calibrated on: its routed ones, or all of them (mode "all")."""
        if self.routed.route_all_tokens:
            return torch.full_like(self.routed_tokens, self.tokens)
        return self.routed_tokens.clone()


class LayerExperts:
    """The MoE blocks of one decoder layer while it is calibrated (see the module docstring)."""

    def __init__(self, layer: nn.Module, blocks: list[MoEBlock], policy: ExpertPolicy, calibrated: bool):
        self.policy, self.calibrated = policy, calibrated
        self.blocks = [BlockExperts(layer, b, route_all=calibrated and policy.mode == "all") for b in blocks]
        self.expert_of = {b.block.expert_linear(e, p): (b, e) for b in self.blocks
                          for e in range(b.block.num_experts) for p in ("gate_proj", "up_proj", "down_proj")}
        self.uncalibrated: dict[str, set[int]] = {b.block.experts: set() for b in self.blocks}

    @contextlib.contextmanager
    def counting_pass(self):
        """One calibration pass over the layer's batches: the counts start again from zero."""
        for b in self.blocks:
            b.routed_tokens.zero_()
            b.tokens, b.counting = 0, True
        try:
            yield
        finally:
            for b in self.blocks:
                b.counting = False

    def falls_back(self, name: str) -> bool:
        """Whether linear `name` (relative to the layer) is to be quantized without calibration: an
        expert's projection whose expert saw fewer than min_tokens in the pass that calibrated it
        (never when the recipe reads no data: then nothing is calibrated anyway). A yes is recorded
        for `stats`."""
        found = self.expert_of.get(name)
        if found is None or not self.calibrated:
            return False
        b, e = found
        if int(b.calibration_tokens()[e]) >= self.policy.min_tokens:
            return False
        self.uncalibrated[b.block.experts].add(e)
        return True

    def stats(self) -> dict:
        """Per block: tokens each expert was calibrated on, its natural routing, and which fell back."""
        out = {}
        for b in self.blocks:
            entry = {"num_experts": b.block.num_experts}
            if self.calibrated:
                entry.update(mode=self.policy.mode, calibration_tokens=b.calibration_tokens().tolist(),
                             routed_tokens=b.routed_tokens.tolist(), tokens=b.tokens,
                             uncalibrated=sorted(self.uncalibrated[b.block.experts]))
            out[b.block.experts] = entry
        return out


@contextlib.contextmanager
def experts_unfused(layer: nn.Module, adapter, policy: ExpertPolicy, calibrated: bool):
    """For the duration of the block: `layer`'s fused experts as per-expert linears (LayerExperts),
    or None for a dense layer. On exit the per-expert weights go back into the fused parameters."""
    blocks = adapter.moe_blocks(layer)
    if not blocks:
        yield None
        return
    experts = LayerExperts(layer, blocks, policy, calibrated)
    for b in experts.blocks:
        b.swap_in()
    try:
        yield experts
    finally:
        for b in experts.blocks:
            b.swap_out()


def summarize(stats_by_layer: dict[int, dict], name_of) -> dict:
    """`quantize --json` / model-card view: per layer and block, min/median/max calibration tokens
    per expert and the experts quantized without calibration (`name_of(layer, block, e)` names them)."""
    layers = {}
    for index in sorted(stats_by_layer):
        for block, entry in stats_by_layer[index].items():
            counts = entry.get("calibration_tokens")
            if counts is None:
                continue
            ordered = sorted(counts)
            layers[name_of(index, block, None)] = {
                "num_experts": entry["num_experts"], "tokens_min": ordered[0], "tokens_median": ordered[len(ordered) // 2],
                "tokens_max": ordered[-1], "uncalibrated": [name_of(index, block, e) for e in entry["uncalibrated"]]}
    return layers


def strategy_needs_stages(layer: nn.Module, adapter) -> bool:
    """MoE layers are calibrated stage by stage: their experts' linears each read their own tokens,
    which the one-pass strategy (one shared input per stage) cannot express."""
    return bool(adapter.moe_blocks(layer))

