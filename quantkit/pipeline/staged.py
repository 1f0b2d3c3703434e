"""The staged strategy: per stage, one observing pass over the calibration batches, then the stage's
linears quantized (fake-quantized in place, so later stages see them quantized). The general case:
any number of batches, any layer structure, any recipe."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from quantkit.finite import require_finite
from quantkit.layer_io import StopForward, to_device
from quantkit.pipeline.residency import check_finite, to_cpu
from quantkit.qtensor import QuantizedWeight
from quantkit.quantizers.base import LayerContext
from quantkit.quantizers.recipe import Recipe


def target_stages(ctx: LayerContext, recipe: Recipe) -> list[list[str]]:
    """The recipe's stages restricted to this layer's target linears, empty stages dropped."""
    stages = [[n for n in stage if n in ctx.schemes] for stage in recipe.stages(ctx)]
    return [stage for stage in stages if stage]


@torch.no_grad()
def quantize_in_place(ctx: LayerContext, recipe: Recipe, name: str, module) -> QuantizedWeight:
    """Quantize one linear and leave it fake-quantized (its weight replaced by the dequantized
    values), which is what everything downstream in the calibration must see. A MoE expert that saw
    too few calibration tokens is quantized without calibration (quantkit.pipeline.experts)."""
    require_finite(ctx.prefix + name + ".weight", module.weight)  # RTN would round a NaN's group to ~0 silently
    if ctx.experts is not None and ctx.experts.falls_back(name):
        qw = recipe.quantize_uncalibrated(name, module, ctx.schemes[name])
    else:
        qw = recipe.quantize_linear(name, module, ctx.schemes[name])
    check_finite(ctx.prefix + name, qw)
    module.weight.data = qw.dequantize(module.weight.dtype).to(module.weight.device)
    return qw


def _run_until_seen(layer, modules: dict, hidden, kwargs, device, compute_dtype, on_input) -> None:
    """One forward of `layer` handing each of `modules`' inputs to `on_input(name, module, x)`, stopped
    as soon as all have been seen: the rest of the layer is not needed yet (for the first stage that
    skips almost the whole layer), which roughly halves true-sequential calibration."""
    seen: set[str] = set()

    def observer(name):
        def hook(module, args):
            on_input(name, module, args[0])  # the very tensor: q/k/v share it by identity (no_grad)
            seen.add(name)
            if len(seen) == len(modules):
                raise StopForward

        return hook

    handles = [m.register_forward_pre_hook(observer(n)) for n, m in modules.items()]
    try:
        layer(to_device(hidden, device).to(compute_dtype), **to_device(kwargs, device))
    except StopForward:
        pass
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def observe_stage(ctx: LayerContext, modules: dict, recipe: Recipe, device, compute_dtype) -> None:
    """Feed the stage's linears' inputs to the recipe's observers, batch by batch; with reference
    inputs, each batch first runs through the unquantized layer so that every observed input comes
    with the same rows' input in the unquantized model."""
    references = ctx.reference_inputs if recipe.needs_reference_inputs else None
    with ctx.experts.counting_pass() if ctx.experts is not None else contextlib.nullcontext():
        _observe_batches(ctx, modules, recipe, device, compute_dtype, references)


def _observe_batches(ctx: LayerContext, modules: dict, recipe: Recipe, device, compute_dtype, references) -> None:
    for b, (hidden, kwargs) in enumerate(ctx.inputs):
        seen_reference: dict[str, torch.Tensor] = {}
        if references is not None:
            twins = {n: ctx.reference_layer.get_submodule(n) for n in modules}
            _run_until_seen(ctx.reference_layer, twins, references[b][0], references[b][1], device, compute_dtype,
                            lambda n, m, x: seen_reference.__setitem__(n, x))
        _run_until_seen(ctx.layer, modules, hidden, kwargs, device, compute_dtype,
                        lambda n, m, x: recipe.observe(n, m, x, reference=seen_reference.get(n)))


class StagedStrategy:
    """Stage by stage; the layer's outputs for the next layer come from one more pass (the driver's)."""

    name = "staged"

    def quantize_layer(self, ctx: LayerContext, recipe: Recipe, device, compute_dtype,
                       observe: bool) -> tuple[dict[str, QuantizedWeight], Optional[list]]:
        results = {}
        for stage in target_stages(ctx, recipe):
            modules = {n: ctx.layer.get_submodule(n) for n in stage}
            if observe:
                observe_stage(ctx, modules, recipe, device, compute_dtype)
            for n, m in modules.items():
                results[ctx.prefix + n] = to_cpu(quantize_in_place(ctx, recipe, n, m))
        return results, None
