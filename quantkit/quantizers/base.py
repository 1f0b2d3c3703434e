"""The quantizer plugin contract and its registry.

The calibration driver knows nothing of any method: it walks the decoder layers, calls the
hooks below, and collects `QuantizedWeight`s. A new method is one file with one subclass
decorated by `@register_quantizer`; the Python API also accepts an instance of a user's own
subclass. Quantizers never import formats, runtime or engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.qtensor import QuantizedWeight
from quantkit.scheme import LinearScheme

_REGISTRY: dict[str, type["Quantizer"]] = {}


@dataclass
class LayerContext:
    """What a quantizer may look at while one decoder layer is on the compute device."""

    index: int
    layer: nn.Module
    prefix: str  # e.g. "model.layers.3."
    adapter: Any  # quantkit.models.ArchitectureAdapter
    config: Any  # the model's transformers config
    schemes: dict[str, LinearScheme]  # names relative to the layer -> scheme of that linear
    inputs: list  # calibration inputs of this layer: list of (hidden_states, kwargs) batches
    run_layer: Callable[[], list]  # runs the layer over `inputs` and returns its outputs
    extras: dict = field(default_factory=dict)


class Quantizer:
    """Base class: override `quantize_linear`; calibrating methods also override `observe`."""

    name: ClassVar[str] = ""
    default_sym: ClassVar[bool] = True
    default_format: ClassVar[str] = "gptq"
    needs_calibration: ClassVar[bool] = True
    options_spec: ClassVar[dict[str, Any]] = {}  # option name -> default value
    default_scheme: ClassVar[dict[str, Any]] = {}  # scheme keys the method implies (SmoothQuant: bits 8, per channel)
    quantizes_activations: ClassVar[bool] = False  # results carry input_quant (W8A8): the format must store it
    needs_observe: ClassVar[bool] = True  # False: the driver skips the per-stage `observe` pass (saves a layer run)
    supports_grids: ClassVar[bool] = False  # honours LinearScheme.grid (a target format's fixed grid, e.g. GGUF)

    def __init__(self, **options):
        unknown = set(options) - set(self.options_spec)
        if unknown:
            allowed = ", ".join(sorted(self.options_spec)) or "none"
            raise QuantkitError(f"unknown option(s) {sorted(unknown)} for method {self.name!r}; allowed: {allowed}")
        self.options = {**self.options_spec, **options}

    def check_scheme(self, scheme) -> None:
        """Reject a QuantScheme the method cannot produce, before any model is loaded."""

    def planned_spec(self, out_features: int, in_features: int, scheme: LinearScheme):
        """The `LinearSpec` this method will produce for a linear, so the format can refuse it before
        calibration starts (an hour of GPTQ must not end in 'awq stores 4-bit weights only')."""
        from quantkit.formats.spec import LinearSpec

        return LinearSpec(out_features, in_features, scheme.bits, scheme.group_size, scheme.sym)

    # -- driver hooks --------------------------------------------------------------------
    def stages(self, ctx: LayerContext) -> list[list[str]]:
        """Groups of linears (relative names) quantized together; later groups see earlier ones quantized."""
        return [[n for n in ctx.adapter.linear_names(ctx.layer) if n in ctx.schemes]]

    def quantize_in_forward(self) -> bool:
        """True when every stage's linears share one input tensor and the stages follow the forward order.

        Then, when the calibration set is a single batch, the driver quantizes each linear from its
        forward pre-hook (observe, quantize, fake-quantize, let the forward go on): one pass per layer
        gives true-sequential results and the next layer's inputs, instead of a pass per stage plus one."""
        return False

    def begin_layer(self, ctx: LayerContext) -> None:
        """Called once the layer is on the compute device, before any stage (AWQ/SmoothQuant transform here)."""

    def observe(self, name: str, module: nn.Module, x: torch.Tensor) -> None:
        """Receives the input activations of a target linear during a calibration pass."""

    def quantize_linear(self, name: str, module: nn.Linear, scheme: LinearScheme) -> QuantizedWeight:
        raise NotImplementedError

    def end_layer(self, ctx: LayerContext) -> None:
        """Called after the layer's linears are quantized; free per-layer state here."""

    def format_extra(self) -> dict[str, Any]:
        """Method-specific keys for the checkpoint's quantization_config (e.g. gptq's damp_percent)."""
        return {}

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, **self.options}


def register_quantizer(cls: type[Quantizer]) -> type[Quantizer]:
    if not cls.name:
        raise ValueError("a quantizer class needs a `name`")
    _REGISTRY[cls.name] = cls
    return cls


def available_methods() -> list[str]:
    _import_builtin()
    return sorted(_REGISTRY)


def get_quantizer(name: str, **options) -> Quantizer:
    _import_builtin()
    if name not in _REGISTRY:
        raise QuantkitError(f"unknown method {name!r}; choose one of: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**options)


def _import_builtin() -> None:
    import importlib

    for module in ("rtn", "gptq", "awq", "smoothquant"):
        try:
            importlib.import_module(f"quantkit.quantizers.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"quantkit.quantizers.{module}":
                raise
