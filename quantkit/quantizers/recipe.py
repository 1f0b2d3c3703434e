"""A recipe: transforms, then one weight quantizer, then refiners, composed into what the calibration pipeline runs.

Steps know nothing of each other; the recipe is the one place that orders them. Per decoder layer
the pipeline calls `begin_layer` (every transform, in order, then the quantizer), feeds `observe`
to every step that observes, asks the quantizer for each linear and lets every transform
`finalize` the result, lets every refiner improve the layer's results together (`refine_layer`),
then `end_layer`. A method name is a recipe too: `awq` is the AWQ transform
finished by round-to-nearest, `smoothquant` the smoothing transform finished by RTN int8 weights.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.qtensor import LinearSpec, QuantizedWeight
from quantkit.quantizers.base import LayerContext, Quantizer, Refiner, Step, Transform, step_class
from quantkit.scheme import LinearScheme


class Recipe:
    """An ordered, validated list of steps: transforms first, one weight quantizer, then refiners."""

    def __init__(self, steps: Sequence[Step]):
        steps = tuple(steps)
        n_refiners = 0
        while n_refiners < len(steps) and isinstance(steps[len(steps) - 1 - n_refiners], Refiner):
            n_refiners += 1
        head, refiners = steps[:len(steps) - n_refiners], steps[len(steps) - n_refiners:]
        if not head or not isinstance(head[-1], Quantizer):
            last = type(head[-1]).__name__ if head else "nothing"
            raise QuantkitError(f"a recipe has one weight quantizer (rtn, gptq) after its transforms and before its "
                                f"refiners, not {last}; add one")
        misplaced = [s.name for s in head[:-1] if not isinstance(s, Transform)]
        if misplaced:
            raise QuantkitError(f"a recipe holds one weight quantizer, after the transforms; {misplaced[0]!r} comes "
                                f"before {head[-1].name!r}: keep one of them, or put a refiner after it")
        self.steps = steps
        self.transforms: tuple[Transform, ...] = head[:-1]  # type: ignore[assignment]
        self.quantizer: Quantizer = head[-1]  # type: ignore[assignment]
        self.refiners: tuple[Refiner, ...] = refiners  # type: ignore[assignment]
        self.quantizer.keep_rounded = any(getattr(r, "needs_rounded_weights", False) for r in refiners)

    @classmethod
    def of(cls, method: Union["Recipe", Step, type]) -> "Recipe":
        """A recipe from a recipe, one step (a transform alone is finished by round-to-nearest) or a step class."""
        if isinstance(method, Recipe):
            return method
        if isinstance(method, type) and issubclass(method, Step):
            method = method()
        if isinstance(method, Transform):
            return cls([method, step_class("rtn")(**method.finishing_rtn_options())])
        if isinstance(method, Quantizer):
            return cls([method])
        raise QuantkitError(f"a method is a name, a recipe or a Step instance, got {type(method).__name__}")

    # -- what the plan needs before any model is loaded -----------------------------------------
    @property
    def name(self) -> str:
        if len(self.steps) == 2 and self.quantizer.name == "rtn" and self.transforms:
            return self.transforms[0].name  # awq, smoothquant: a transform finished by rounding
        return "+".join(s.name for s in self.steps)

    @property
    def needs_calibration(self) -> bool:
        return any(s.needs_calibration for s in self.steps)

    @property
    def quantizes_activations(self) -> bool:
        return any(s.quantizes_activations for s in self.steps)

    @property
    def default_scheme(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for s in self.steps:
            out.update(s.default_scheme)
        return out

    @property
    def default_sym(self) -> bool:
        return next((s.default_sym for s in self.steps if s.default_sym is not None), True)

    @property
    def default_format(self) -> str:
        return next(s.default_format for s in self.steps if s.default_format)

    def check_scheme(self, scheme) -> None:
        for s in self.steps:
            s.check_scheme(scheme)

    def planned_spec(self, out_features: int, in_features: int, scheme: LinearScheme) -> LinearSpec:
        spec = LinearSpec(out_features, in_features, scheme.bits, scheme.group_size, scheme.sym)
        for s in (self.quantizer, *self.transforms):
            spec = s.planned_spec(spec)
        return spec

    def describe(self) -> dict[str, Any]:
        """The method and its options, for the model card and the run's fingerprint."""
        if len(self.steps) == 1:
            return self.quantizer.describe()
        if self.transforms and self.name == self.transforms[0].name:  # a transform finished by rounding (awq)
            return {**self.transforms[0].describe(), "weights": "rtn"}
        return {"method": self.name, **{s.name: s.options for s in self.steps}}

    def format_extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for s in self.steps:
            out.update(s.format_extra())
        return out

    # -- what the calibration pipeline calls, per decoder layer -------------------------------
    @property
    def observers(self) -> list[Step]:
        return [s for s in self.steps if s.observes]

    @property
    def needs_observe(self) -> bool:
        return bool(self.observers)

    @property
    def needs_reference_inputs(self) -> bool:
        return any(s.needs_reference_inputs for s in self.steps)

    @property
    def calibrates_on_float_inputs(self) -> bool:
        """Whether each layer is calibrated on the unquantized model's hidden states rather than on
        the outputs of the layers quantized before it. The quantizer decides when it has a preference
        (GPTQ's Hessians come from the quantized stream, so `awq,gptq` stays there); otherwise the
        last transform that has one (AWQ alone: its `inputs` option)."""
        for s in (self.quantizer, *reversed(self.transforms)):
            if s.calibration_stream is not None:
                return s.calibration_stream == "float"
        return False

    def stages(self, ctx: LayerContext) -> list[list[str]]:
        return self.quantizer.stages(ctx)

    def quantize_in_forward(self) -> bool:
        # a refiner needs the layer's inputs after its linears are quantized, which one forward consumes
        # (a step comparing with the unquantized model's inputs gets them from a forward of their own)
        return self.quantizer.quantize_in_forward() and not self.refiners

    def begin_layer(self, ctx: LayerContext) -> None:
        for s in self.steps:
            s.begin_layer(ctx)

    def observe(self, name: str, module: nn.Module, x: torch.Tensor, reference: torch.Tensor | None = None) -> None:
        for s in self.observers:
            if s.needs_reference_inputs:
                s.observe(name, module, x, reference=reference)
            else:
                s.observe(name, module, x)

    def quantize_linear(self, name: str, module: nn.Linear, scheme: LinearScheme) -> QuantizedWeight:
        qw = self.quantizer.quantize_linear(name, module, scheme)
        for t in self.transforms:
            qw = t.finalize(name, qw)
        return qw

    @property
    def uncalibrated_method(self) -> str:
        return self.quantizer.uncalibrated_method

    def quantize_uncalibrated(self, name: str, module: nn.Linear, scheme: LinearScheme) -> QuantizedWeight:
        """`name` quantized without calibration (see Quantizer.quantize_uncalibrated), finalized by the transforms."""
        qw = self.quantizer.quantize_uncalibrated(name, module, scheme)
        for t in self.transforms:
            qw = t.finalize(name, qw)
        return qw

    def refine_layer(self, ctx: LayerContext, results: dict[str, QuantizedWeight], device,
                     compute_dtype: torch.dtype) -> dict[str, QuantizedWeight]:
        """The layer's quantized results as the refiners leave them, in order (the results unchanged
        when the recipe has none)."""
        ctx.rounded_weight = self.quantizer.rounded_weight
        ctx.plain_rtn = lambda name: self.plain_rtn(ctx, name)
        for r in self.refiners:
            results = r.refine_layer(ctx, results, device, compute_dtype)
        return results

    def layer_reports(self, index: int) -> dict[str, dict]:
        """{refiner name: what it did to layer `index`} for the refiners that report (Refiner.layer_report)."""
        reports = {r.name: r.layer_report(index) for r in self.refiners}
        return {name: rep for name, rep in reports.items() if rep is not None}

    def refinement_report(self, layer_stats: dict[int, dict]) -> Optional[tuple[dict, str]]:
        """(summary per refiner, model-card section) from the per-layer reports the pipeline kept in its layer
        stats (`layer_reports`, restored on resume); None when no refiner reported."""
        summaries, lines = {}, []
        for r in self.refiners:
            reports = {int(i): s["refiners"][r.name] for i, s in layer_stats.items()
                       if r.name in (s or {}).get("refiners", {})}
            if reports:
                summaries[r.name], line = r.summarize(reports)
                lines.append(line)
        if not summaries:
            return None
        return summaries, "\n".join(["", "## Refinement", "", *lines, ""])

    def plain_rtn(self, ctx: LayerContext, name: str) -> QuantizedWeight:
        """Linear `name` (relative to the layer) of the unquantized layer (after the transforms) rounded
        to nearest on the quantizer's grid with plain min/max ranges: codes and ranges only, the caller
        keeps what the transforms' `finalize` added to the quantizer's result."""
        module = ctx.reference_layer.get_submodule(name)
        return self.quantizer.plain_round_to_nearest(module.weight.data, module.bias, ctx.schemes[name])

    def end_layer(self, ctx: LayerContext) -> None:
        for s in self.steps:
            s.end_layer(ctx)


def parse_method(method: Union[str, Iterable[str]]) -> list[str]:
    """`gptq`, `awq,gptq`, ["smoothquant", "gptq"] -> the step names, lower-cased."""
    if not isinstance(method, (str, list, tuple)):
        raise QuantkitError(f"method {method!r} must be a step name such as gptq, or a list of them")
    names = method.split(",") if isinstance(method, str) else list(method)
    names = [str(n).strip().lower() for n in names if str(n).strip()]
    if not names:
        raise QuantkitError("no method given; use e.g. --method gptq or --method awq,gptq")
    return names


def build_recipe(method: Union[str, Iterable[str], Recipe, Step, type], options: dict[str, Any]) -> Recipe:
    """The recipe a method names, with each option handed to the one step that declares it.

    An option no step declares, or one two steps both declare, is refused: nothing is dropped
    silently. Options given with a ready-made Recipe or Step instance are refused too (set them
    on the instance)."""
    if isinstance(method, (list, tuple)) and method and all(isinstance(m, Step) for m in method):
        method = Recipe(method)  # ready steps, in order
    if isinstance(method, (Recipe, Step)) or (isinstance(method, type) and issubclass(method, Step)):
        if options and not isinstance(method, type):
            raise QuantkitError(f"options {sorted(options)} were given with a ready {type(method).__name__} "
                                "instance; pass them to its constructor instead")
        return Recipe.of(method if not isinstance(method, type) else method(**options))
    classes = [step_class(n) for n in parse_method(method)]
    if len({c.name for c in classes}) != len(classes):
        raise QuantkitError(f"method {method!r} names a step twice")
    finishing = classes[-1].kind == "transform"
    if finishing:
        classes.append(step_class("rtn"))
    owners: dict[str, list[str]] = {}
    for c in classes:
        for key in c.options_spec:
            if finishing and c is classes[-1] and key in classes[-2].options_spec:
                continue  # the transform's own option, which it hands to its finishing rounding
            owners.setdefault(key, []).append(c.name)
    unknown = sorted(k for k in options if k not in owners)
    if unknown:
        allowed = ", ".join(sorted(owners)) or "none"
        raise QuantkitError(f"unknown option(s) {unknown} for method {'+'.join(c.name for c in classes)!r}; "
                            f"allowed: {allowed}")
    shared = sorted(k for k in options if len(owners[k]) > 1)
    if shared:
        raise QuantkitError(f"option {shared[0]!r} belongs to several steps ({', '.join(owners[shared[0]])}), "
                            "so it cannot say which one it sets; pass ready Step instances instead")
    chosen = [{k: v for k, v in options.items() if owners[k] == [c.name]} for c in classes]
    steps = [c(**o) for c, o in zip(classes[:-1], chosen[:-1])]
    last = {**steps[-1].finishing_rtn_options(), **chosen[-1]} if finishing else chosen[-1]
    return Recipe(steps + [classes[-1](**last)])
