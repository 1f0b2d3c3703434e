"""The recipe-step contract and its registry.

A recipe is an ordered list of steps: any number of *transforms* (SmoothQuant smoothing, AWQ
scales, ...), then one *weight quantizer* (RTN, GPTQ, ...), then any number of *refiners* (sign-
gradient rounding), which improve a quantized layer's weights together. Each step is a plugin that knows nothing
of the others; `quantkit.quantizers.recipe.Recipe` composes them for the calibration pipeline,
which knows nothing of any one method. A new method is one file with one subclass decorated by
`@register_step`; the Python API also accepts an instance of a user's own subclass. Steps never
import formats, runtime or engine: they produce `QuantizedWeight`s and `LinearSpec`s (the
format-neutral description of what they will produce), nothing about layouts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.qtensor import LinearSpec
from quantkit.qtensor import QuantizedWeight
from quantkit.reduction import SampleLayout
from quantkit.scheme import LinearScheme

_REGISTRY: dict[str, type["Step"]] = {}


@dataclass
class LayerContext:
    """What a step may look at while one decoder layer is on the compute device."""

    index: int
    layer: nn.Module
    prefix: str  # e.g. "model.layers.3."
    adapter: Any  # quantkit.models.ArchitectureAdapter
    config: Any  # the model's transformers config
    schemes: dict[str, LinearScheme]  # names relative to the layer -> scheme of that linear
    inputs: list  # calibration inputs of this layer: list of (hidden_states, kwargs) batches
    run_layer: Callable[[], list]  # runs the layer over `inputs` and returns its outputs
    # for steps that need reference inputs: the layer as the unquantized model has it (after the
    # transforms, which are exact in full precision) and the unquantized model's inputs of this layer
    reference_layer: Optional[nn.Module] = None
    reference_inputs: Optional[list] = None
    # for refiners: reference_layer's outputs on reference_inputs (the pipeline runs it once, after the
    # quantizer, or the one-pass strategy while capturing its references; then reference_inputs is
    # cleared: the refiner's targets are the next layer's reference inputs)
    reference_outputs: Optional[list] = None
    # a MoE layer's experts while it is calibrated (quantkit.pipeline.experts.LayerExperts), else None
    experts: Any = None
    # where `inputs` sit in the whole calibration set (data-parallel ranks hold a share of it): every
    # sum, maximum or sample a step takes over the inputs goes through it (see quantkit.reduction)
    samples: Optional[SampleLayout] = None
    # for refiners: the quantizer's Quantizer.rounded_weight (the recipe sets it before refine_layer)
    rounded_weight: Optional[Callable[[str], Optional[torch.Tensor]]] = None
    # for refiners: a linear (name relative to the layer) of `reference_layer` rounded to nearest on the
    # quantizer's grid with plain min/max ranges (the recipe sets it: Recipe.plain_rtn)
    plain_rtn: Optional[Callable[[str], QuantizedWeight]] = None

    def row_layout(self, name: str) -> Optional[SampleLayout]:
        """The layout a sum over linear `name`'s input rows follows: `samples`, except for a routed
        expert, whose rows are the tokens routed to it, not the dense rows the layout counts (a plain
        running sum then; MoE models are calibrated in one process, see api._expert_policy)."""
        if self.experts is not None and name in self.adapter.routed_linears(self.layer):
            return None
        return self.samples


def _check_option_type(step: str, key: str, value: Any, default: Any, words: tuple[str, ...]) -> None:
    """An option given with its default's type (bool, whole number, number), or one of its words:
    `desc_act=maybe` would be truthy and `damp_percent=abc` would fail mid-run. Options whose
    default is None, a string or a list are checked by the step itself."""
    if isinstance(value, str) and value.strip().lower() in words:
        return
    if isinstance(default, bool):
        ok, kind = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, kind = isinstance(value, int) and not isinstance(value, bool), "a whole number"
    elif isinstance(default, float):
        ok, kind = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    else:
        return
    if not ok:
        also = "".join(f" or {w!r}" for w in words)
        raise QuantkitError(f"option {key}={value!r} of method {step!r} must be {kind}{also} (default {default!r})")


class Step:
    """Base of every recipe step. Options are validated against `options_spec` (name -> default)."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""  # "transform" or "quantizer"
    options_spec: ClassVar[dict[str, Any]] = {}
    default_scheme: ClassVar[dict[str, Any]] = {}  # scheme keys the step implies (SmoothQuant: bits 8, per channel)
    default_sym: ClassVar[bool | None] = None  # the grid the step is usually run with; None: no preference
    default_format: ClassVar[str | None] = None
    needs_calibration: ClassVar[bool] = True
    quantizes_activations: ClassVar[bool] = False  # results carry input_quant (W8A8): the format must store it
    observes: ClassVar[bool] = False  # wants `observe` calls with each target linear's inputs
    # wants each linear's input in the unquantized model too (`observe(..., reference=)`): the pipeline
    # then runs a full-precision copy of every layer on the full-precision hidden states beside it
    needs_reference_inputs: ClassVar[bool] = False
    # which hidden states the next layer is calibrated on: "quantized" (the outputs of the layers
    # quantized so far, GPTQ's flow), "float" (the unquantized model's, AutoAWQ's flow) or None (no
    # preference); the recipe settles it (Recipe.calibrates_on_float_inputs)
    calibration_stream: ClassVar[str | None] = None
    supports_grids: ClassVar[bool] = False  # honours LinearScheme.grid (a target format's fixed grid, e.g. GGUF)
    # words a numeric option also takes (SmoothQuant's alpha: "auto"); other options must have their default's type
    option_words: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init__(self, **options):
        unknown = set(options) - set(self.options_spec)
        if unknown:
            allowed = ", ".join(sorted(self.options_spec)) or "none"
            raise QuantkitError(f"unknown option(s) {sorted(unknown)} for method {self.name!r}; allowed: {allowed}")
        for key, value in options.items():
            _check_option_type(self.name, key, value, self.options_spec[key], self.option_words.get(key, ()))
        self.options = {**self.options_spec, **options}

    def check_scheme(self, scheme) -> None:
        """Reject a QuantScheme the step cannot produce, before any model is loaded."""

    def planned_spec(self, spec: LinearSpec) -> LinearSpec:
        """The `LinearSpec` after this step (act-order, activation quantization), so the format can
        refuse it before calibration starts (an hour of GPTQ must not end in 'awq stores 4-bit
        weights only')."""
        return spec

    def begin_layer(self, ctx: LayerContext) -> None:
        """Called once the layer is on the compute device, before any linear is quantized."""

    def observe(self, name: str, module: nn.Module, x: torch.Tensor, reference: torch.Tensor | None = None) -> None:
        """Receives the input activations of a target linear during a calibration pass; with
        `needs_reference_inputs`, `reference` holds the same rows' input in the unquantized model."""

    def end_layer(self, ctx: LayerContext) -> None:
        """Called after the layer's linears are quantized; free per-layer state here."""

    def format_extra(self) -> dict[str, Any]:
        """Method-specific keys for the checkpoint's quantization_config (e.g. gptq's damp_percent)."""
        return {}

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, **self.options}


class Transform(Step):
    """A step that changes the layer before its weights are quantized (smoothing, scales, rotations):
    exactly in full precision, or on purpose (clipping). It may also annotate each result."""

    kind = "transform"

    def finishing_rtn_options(self) -> dict[str, Any]:
        """Options of the round-to-nearest step that finishes this transform alone (awq, smoothquant).

        Their searches (AWQ's scales and clipping, SmoothQuant's smoothing) simulate plain min/max
        rounding, so the weights are finished on that same grid, without RTN's range search; a
        transform whose search simulates another grid says so here. A user's option still wins."""
        return {"mse": False}

    def finalize(self, name: str, qw: QuantizedWeight) -> QuantizedWeight:
        """The quantized result of `name` as this step leaves it (e.g. SmoothQuant adds input_quant)."""
        return qw


class Quantizer(Step):
    """The weight quantizer that ends a recipe: override `quantize_linear` (and `observe` to calibrate)."""

    kind = "quantizer"
    default_sym = True
    default_format = "gptq"
    observes = True

    def stages(self, ctx: LayerContext) -> list[list[str]]:
        """Groups of linears (relative names) quantized together; later groups see earlier ones quantized."""
        return [[n for n in ctx.adapter.linear_names(ctx.layer) if n in ctx.schemes]]

    def quantize_in_forward(self) -> bool:
        """True when every stage's linears share one input tensor and the stages follow the forward order.

        Then, when the calibration set is a single batch, the pipeline may quantize each linear from
        its forward pre-hook (observe, quantize, fake-quantize, let the forward go on): one pass per
        layer gives true-sequential results and the next layer's inputs."""
        return False

    def quantize_linear(self, name: str, module: nn.Linear, scheme: LinearScheme) -> QuantizedWeight:
        raise NotImplementedError

    # set by the recipe when a refiner asks for `rounded_weight` (keeping them costs a copy per linear)
    keep_rounded: bool = False

    def rounded_weight(self, name: str) -> Optional[torch.Tensor]:
        """The fp32 weight of linear `name` (relative to the current layer) whose round-to-nearest on
        the result's grid gives the result's codes, until `end_layer`: GPTQ's weights as each column was
        when it was rounded, with the earlier columns' errors compensated. None where the quantizer
        keeps none (a refiner then starts from the unquantized weight)."""
        return None

    uncalibrated_method: ClassVar[str] = "rtn"  # what `quantize_uncalibrated` does, for the model card

    def quantize_uncalibrated(self, name: str, module: nn.Linear, scheme: LinearScheme) -> QuantizedWeight:
        """`name` quantized without calibration data, when the pipeline has too few tokens for it (a MoE
        expert the router seldom chose): what was observed for it is dropped and the weight is rounded
        to nearest on this quantizer's grid (with its range search: `uncalibrated_grid_options`),
        labelled with the act-order the run declares (its trivial g_idx is valid under it), so the
        checkpoint keeps one scheme."""
        self.discard(name)
        qw = self.round_to_nearest(module, scheme)
        if scheme.grid is None:
            qw.act_order = self.planned_spec(LinearSpec.of(qw)).act_order
        return qw

    def round_to_nearest(self, module: nn.Linear, scheme: LinearScheme) -> QuantizedWeight:
        """`module`'s weight rounded to nearest, no data: on a GGUF type's blocks with the parameters
        llama.cpp chooses, else on the scheme's grid with `uncalibrated_grid_options`' range search."""
        from quantkit.formats.gguf.types import ggml_type
        from quantkit.quantizers.gguf_grid import rtn_on_grid
        from quantkit.quantizers.grid import rtn_quantize

        if scheme.grid is not None:
            return rtn_on_grid(module.weight.data, ggml_type(scheme.grid), module.bias)
        return rtn_quantize(module.weight.data, scheme.bits, scheme.group_size, scheme.sym, module.bias,
                            **self.uncalibrated_grid_options())

    def plain_round_to_nearest(self, weight: torch.Tensor, bias, scheme: LinearScheme) -> QuantizedWeight:
        """`weight` rounded to nearest on this quantizer's grid (its `sym_range`) with plain min/max
        ranges, no search: auto-round's start, for a refiner that restarts from it."""
        from quantkit.quantizers.grid import rtn_quantize

        if scheme.grid is not None:
            raise QuantkitError("round-to-nearest on a GGUF block grid is llama.cpp's own choice of parameters; "
                                "a refiner's restart needs an integer grid with a zero point")
        return rtn_quantize(weight, scheme.bits, scheme.group_size, scheme.sym, bias, mse=False,
                            sym_range=self.uncalibrated_grid_options()["sym_range"])

    def uncalibrated_grid_options(self) -> dict[str, Any]:
        """How a group's range is chosen for a weight rounded without data: the range search this
        quantizer's own groups get (GPTQ's and RTN's `mse`, RTN's `sym_range`), so a fallback expert
        sits on the same kind of grid as its calibrated neighbours; plain min/max where it has none."""
        return {"mse": bool(self.options.get("mse", False)), "sym_range": self.options.get("sym_range", "centred")}

    def discard(self, name: str) -> None:
        """Forget what was observed for `name` (it is being quantized without it)."""


class Refiner(Step):
    """A step after the weight quantizer that improves a whole decoder layer's quantized weights
    together (sign-gradient rounding: quantkit.quantizers.signround), against the layer's output.

    It runs once the quantizer has quantized every linear of the layer and before the layer's outputs
    become the next layer's inputs; the recipe then runs the layer again for them (so a recipe with
    a refiner is calibrated stage by stage, never inside one forward)."""

    kind = "refiner"

    def refine_layer(self, ctx: LayerContext, results: dict[str, QuantizedWeight], device,
                     compute_dtype: torch.dtype) -> dict[str, QuantizedWeight]:
        """`results` (full names -> the quantizer's weights, on the CPU) improved; the layer's linears
        left fake-quantized with what it returns."""
        raise NotImplementedError

    def layer_report(self, index: int) -> Optional[dict]:
        """What the step did to layer `index` (JSON-able), kept with the layer in the progress store so a
        resumed run reports every layer; None: nothing to report."""
        return None

    def summarize(self, reports: dict[int, dict]) -> tuple[dict, str]:
        """(the run's summary of the per-layer reports, one model-card line saying it)."""
        return {"layers": len(reports)}, f"- {self.name}: {len(reports)} layers"


def register_step(cls: type[Step]) -> type[Step]:
    if not cls.name or cls.kind not in ("transform", "quantizer", "refiner"):
        raise ValueError("a recipe step class needs a `name` and must derive from Transform, Quantizer or Refiner")
    _REGISTRY[cls.name] = cls
    return cls


def available_methods() -> list[str]:
    _import_builtin()
    return sorted(_REGISTRY)


def step_class(name: str) -> type[Step]:
    _import_builtin()
    if name not in _REGISTRY:
        raise QuantkitError(f"unknown method {name!r}; choose one of: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def get_quantizer(name: str, **options) -> Step:
    """One registered step by name (a weight quantizer or a transform), with its options."""
    return step_class(name)(**options)


def _import_builtin() -> None:
    import importlib

    for module in ("rtn", "gptq", "awq", "smoothquant", "signround"):
        importlib.import_module(f"quantkit.quantizers.{module}")
