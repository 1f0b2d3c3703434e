"""How many calibration sequences go through a decoder layer per forward, and which strategy runs.

A recipe whose weight quantizer can work inside one forward (GPTQ, true-sequential) saves whole
passes when the calibration set is one batch, so it may take more memory per forward; the others
gain nothing from one batch, and their memory should not grow with the calibration set.
"""
from __future__ import annotations

import torch

from quantkit.quantizers.recipe import Recipe

ONE_PASS_BATCH_BUDGET = 4 << 30  # bytes of transient activations one calibration forward may take
STAGED_BATCH_BUDGET = 1 << 30


def runs_in_one_pass(recipe: Recipe) -> bool:
    """Whether the recipe can use the one-forward-per-layer strategy when calibration is one batch."""
    return recipe.needs_calibration and recipe.needs_observe and recipe.quantize_in_forward()


def auto_batch_size(config, num_samples: int, seq_len: int, dtype: torch.dtype, budget: int = ONE_PASS_BATCH_BUDGET,
                    reference_stages: bool = False) -> int:
    """Calibration sequences per forward: all of them when one decoder layer's forward over the whole
    set stays within `budget`, else as many as fit. Read from the config alone, never from free
    memory, so a rerun batches (and rounds) the same. With `reference_stages` (the one-pass strategy
    for a recipe comparing with the unquantized model) each sequence's input of every stage in the
    unquantized layer is held too: attention in (q/k/v and o), MLP in (gate/up and down)."""
    config = getattr(config, "text_config", None) or config
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "d_model", 0) or 4096)
    intermediate = int(getattr(config, "intermediate_size", 0) or getattr(config, "ffn_dim", 0) or 4 * hidden)
    heads = int(getattr(config, "num_attention_heads", 0) or 32)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # gate, up and their product; a few hidden-sized tensors; attention scores and their softmax
    per_sequence = seq_len * itemsize * (3 * intermediate + 4 * hidden + 2 * heads * seq_len)
    if reference_stages:
        per_sequence += seq_len * itemsize * (3 * hidden + intermediate)
    return max(1, min(num_samples, budget // per_sequence))


def calibration_batch_size(config, recipe: Recipe, num_samples: int, seq_len: int) -> int:
    """The default batch size for this recipe: one batch where the one-pass strategy can use it."""
    one_pass = runs_in_one_pass(recipe)
    budget = ONE_PASS_BATCH_BUDGET if one_pass else STAGED_BATCH_BUDGET
    return auto_batch_size(config, num_samples, seq_len, torch.float32, budget,
                           reference_stages=one_pass and recipe.needs_reference_inputs)
