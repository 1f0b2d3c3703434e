"""Transforms run as a pass of their own before a float preset is quantized (`float_checkpoint.write` with
method "smoothquant[+gptq]" or "awq[+gptq]").

Why a pass: the float writer rounds (or runs GPTQ) onto the preset's grid after the static input scales are
measured, and those must be measured on the transformed model. So the transform runs first over the whole
model, layer by layer on the calibration tokens, through quantkit's pipeline (which owns the forward passes,
hooks and MoE routing) with `KeepWeights` as its weight step: every weight stays as the transform left it.
Each pass is a registered entry: the transform class, the options it takes there, and its method name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.qtensor import QuantizedWeight
from quantkit.quantizers.base import Quantizer, Transform
from quantkit.scheme import LinearScheme
from quantkit.scheme_presets import SchemePreset


class _Unchanged:
    """A linear's weight as the pass leaves it: what the pipeline asks of a result, and nothing more."""

    act_order = "none"
    full_precision = True  # the progress store saves the weight with the layer's other tensors

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.scales = torch.ones(1)  # the pipeline checks a result's scales are finite

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    def to(self, device) -> "_Unchanged":
        return self


class KeepWeights(Quantizer):
    """A pass's weight step: every linear keeps its (transformed) full-precision weight."""

    name = "keep"
    observes = False
    needs_calibration = False

    def quantize_linear(self, name: str, module: nn.Linear, scheme: LinearScheme) -> QuantizedWeight:
        return _Unchanged(module.weight.data)  # type: ignore[return-value]

    def quantize_uncalibrated(self, name: str, module: nn.Linear, scheme: LinearScheme) -> QuantizedWeight:
        """A MoE expert too few tokens reached is kept too (the base class would round it to the scheme)."""
        return _Unchanged(module.weight.data)  # type: ignore[return-value]


class PresetTransform:
    """Mixed into a pass's transform (before its integer transform class): the preset, not the integer path's
    per-linear scheme, says what the weights become, so any scheme passes and the plan's spec stays as it is."""

    def check_scheme(self, scheme) -> None:
        """Any scheme (see the class docstring)."""

    def planned_spec(self, spec):
        return spec


@dataclass(frozen=True)
class FloatPass:
    """A transform the float writer runs first: `make(preset, options)` makes the step (and refuses a preset
    or option it cannot serve); `options` are those it takes before a float preset. An option outside them is
    refused with its own reason where `reasons` has one ((option, message with {preset}) pairs), else naming
    the options it takes, followed by `refusal_hint`."""

    name: str
    build: Callable[..., Transform]
    options: tuple[str, ...]
    refusal_hint: str = ""
    reasons: tuple[tuple[str, str], ...] = ()

    def make(self, preset: SchemePreset, options: dict) -> Transform:
        """The pass's transform for `preset`; an option it does not take is refused (class docstring)."""
        unknown = sorted(set(options) - set(self.options))
        for option, reason in self.reasons:
            if option in unknown:
                raise QuantkitError(reason.format(preset=preset.name))
        if unknown:
            raise QuantkitError(f"{self.name} before --scheme {preset.name} takes {', '.join(self.options)}; drop "
                                f"{', '.join(unknown)}{self.refusal_hint}")
        return self.build(preset, **options)

    def split(self, options: dict) -> tuple[dict, dict]:
        """(this pass's options, the rest: the rounding's or GPTQ's)."""
        return ({k: v for k, v in options.items() if k in self.options},
                {k: v for k, v in options.items() if k not in self.options})


PASSES: dict[str, FloatPass] = {}


def register(p: FloatPass) -> FloatPass:
    PASSES[p.name] = p
    return p


def registered() -> dict[str, FloatPass]:
    """Every pass by name (each module registers its own on import)."""
    from quantkit.quantizers import awq_float, smoothquant_float  # noqa: F401

    return PASSES


def parse_method(method: str, preset: SchemePreset) -> tuple[Optional[FloatPass], str]:
    """("smoothquant+gptq" ->) the pass a float method starts with (None) and the method that finishes it. AWQ
    before a preset with integer weights (W4AFP8) is no pass: the integer AWQ transform (its clipping included)
    runs inside the integer recipe that finishes it, "awq" or "awq,gptq"."""
    head, _, rest = method.partition("+")
    if head == "awq" and preset.weights.kind == "int":
        return None, "awq" if rest in ("", "rtn") else f"awq,{rest}"
    if head in registered():
        return PASSES[head], rest or "rtn"
    return None, method


def pass_scheme(preset: SchemePreset) -> LinearScheme:
    """The pipeline's per-linear scheme during a pass: the preset's group size (a search that normalises per
    group, AWQ's weight mean, reads it); nothing is rounded to it."""
    w = preset.weights
    group = w.group_size if w.strategy in ("group", "tensor_group") and w.group_size else -1
    return LinearScheme(bits=w.bits if w.bits in (2, 3, 4, 8) else 8, group_size=group, sym=True)


def run_pass(model: nn.Module, preset: SchemePreset, p: FloatPass, linears: list[str],
             calibration: Optional[torch.Tensor], options: dict, batch_size: int = 8, progress: bool = False,
             device: torch.device | str = "cpu", store=None):
    """Transform `model` in place for `preset` with pass `p` (the groups feeding any of `linears`), layer by
    layer on `calibration` (token ids); returns the transform (its `search_log` says what it chose per layer,
    for the layers it ran). With a `store` (quantkit.progress) each transformed layer is saved there and the
    layers already there are restored instead (a resumed run)."""
    from quantkit.models import get_adapter
    from quantkit.pipeline import quantize_model
    from quantkit.quantizers.recipe import Recipe

    if calibration is None:
        raise QuantkitError(f"{p.name} before --scheme {preset.name} measures activations: it needs calibration "
                            "token ids")
    step = p.make(preset, options)
    quantize_model(model, get_adapter(model), Recipe([step, KeepWeights()]), dict.fromkeys(linears, pass_scheme(preset)),
                   calibration, batch_size=batch_size, progress=progress, device=device, store=store)
    return step
