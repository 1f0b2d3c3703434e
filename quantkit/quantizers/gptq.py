"""GPTQ as a quantizer plugin: Hessians from the calibration hooks, the solver in gptq_core.

True-sequential (default on) quantizes q/k/v, then o, then gate/up, then down, so later linears see
the earlier ones already quantized (inside one forward pass when calibration is one batch, else
re-running the layer between stages). Linears of one stage that share their input and scheme
(q/k/v, gate/up) are solved as one stacked matrix. In a data-parallel run each rank solves a share
of that matrix's rows (quantkit.quantizers.gptq_shares).
"""
from __future__ import annotations

import json
import warnings
from dataclasses import replace

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.formats.gguf.types import ggml_type
from quantkit.quantizers.base import LayerContext, Quantizer, register_step
from quantkit.quantizers.gptq_core import (LayerInputStatistics, act_order_kind, asymmetric_target,
                                           check_gptaq_alpha)
from quantkit.quantizers.gptq_shares import SharedSolver
from quantkit.quantizers.gguf_grid import choose_grid
from quantkit.quantizers.grid import check_sym_range
from quantkit.scheme import LinearScheme


# options of GPTQ onto a float preset's grid that the integer solve has no counterpart for
FLOAT_ONLY_OPTIONS = ("input_rounding", "input_rounding_alpha")


def float_only_refusal(given: dict) -> str:
    names = ", ".join(f"{k}={json.dumps(v)}" for k, v in given.items())
    return (f"option {names} rounds GPTQ's inputs as a float preset's runtime does; it applies to --scheme presets "
            "with float weights and quantized inputs (NVFP4, MXFP4, FP8_DYNAMIC, ...), not to integer weights: "
            "drop it")


@register_step
class GPTQQuantizer(Quantizer):
    name = "gptq"
    supports_grids = True
    calibration_stream = "quantized"  # each Hessian sees the errors of the layers quantized before it
    options_spec = {
        "damp_percent": 0.01,
        "block_size": 128,
        # act-order with static groups: columns in descending Hessian-diagonal order, group scales fixed
        # up front from the original weights, so g_idx stays trivial and every runtime loads it.
        # Measured on the demo (w4g64 sym, 64 x 512 Lee calibration): see docs/defaults.yaml
        "desc_act": True,
        "static_groups": True,
        "true_sequential": True,
        # each group's range shrunk to its lowest rounding error (grid.find_qparams): lower KL on both
        # held-out texts (docs/defaults.yaml), computed once per group with static groups
        "mse": True,
        # the search weighs each weight's rounding error by its input's mean square (the Hessian's
        # diagonal), as the layer's output error does: lower KL on both held-out texts (docs/defaults.yaml)
        "weighted_search": True,
        # where a symmetric group's grid puts +-absmax (quantizers.grid.SYM_RANGES): "full" is
        # auto-round's signed absmax/8 (docs/signround.md has its measurement)
        "sym_range": "centred",
        "offload_hessians": False,
        # GPTAQ: quantize each linear to reproduce the unquantized model's output from the quantized
        # model's inputs (needs the unquantized model's inputs beside them: the staged strategy, one
        # more forward per layer); gptaq_alpha scales the correction (see gptq_core.asymmetric_target)
        "gptaq": False,
        "gptaq_alpha": 0.25,
        # GPTQ on a float preset whose inputs the runtime rounds (NVFP4, MXFP4, FP8_DYNAMIC...): declared here so
        # a run's plan (this recipe) carries them to the float solve, which reads them (quantizers.gptq_float);
        # the integer solve has no input rounding and refuses them (FLOAT_ONLY_OPTIONS)
        "input_rounding": None,
        "input_rounding_alpha": 0.0,
    }

    def __init__(self, **options):
        super().__init__(**options)
        o = self.options
        if not 0 < float(o["damp_percent"]) < 1:
            raise QuantkitError(f"damp_percent must be in (0, 1), got {o['damp_percent']}")
        if int(o["block_size"]) < 1:
            raise QuantkitError(f"block_size must be positive, got {o['block_size']}")
        check_sym_range(o["sym_range"], "gptq option ")
        check_gptaq_alpha(o["gptaq_alpha"])
        self.needs_reference_inputs = bool(o["gptaq"])  # an instance attribute: the recipe reads it
        self._stats = LayerInputStatistics(with_cross=self.needs_reference_inputs, offload=bool(o["offload_hessians"]))
        self._stage_mates: dict[str, list[str]] = {}
        self._stacked: dict[str, tuple] = {}  # results solved along with an earlier linear of the stage
        self._rounded: dict[str, torch.Tensor] = {}  # this layer's rounded_weight, when keep_rounded
        self._ctx: LayerContext | None = None
        self.solver = SharedSolver()  # data-parallel runs: each rank solves a share of the rows
        self.layer_stats: dict[str, dict] = {}

    def solver_options(self) -> dict:
        """This step's options as `gptq_core.gptq_quantize` takes them (the quantizer and the sensitivity
        report's single-linear solves both pass these, so the two cannot drift apart)."""
        o = self.options
        return {"block_size": int(o["block_size"]), "damp_percent": float(o["damp_percent"]),
                "act_order": bool(o["desc_act"]), "static_groups": bool(o["static_groups"]), "mse": bool(o["mse"]),
                "weighted_search": bool(o["weighted_search"]), "sym_range": o["sym_range"]}

    def _float_only_set(self) -> dict:
        """The float-only options given a value other than their default."""
        return {k: self.options[k] for k in FLOAT_ONLY_OPTIONS if self.options[k] != self.options_spec[k]}

    def describe(self) -> dict:
        """Every option, less the float-only ones where unset: an integer run's card, recipe and resume
        fingerprint stay as they were before the float solve's options were declared here."""
        shown = self._float_only_set()
        return {k: v for k, v in super().describe().items() if k not in FLOAT_ONLY_OPTIONS or k in shown}

    def begin_layer(self, ctx: LayerContext) -> None:
        given = self._float_only_set()
        if given:  # a plan refuses them earlier (plan.resolve_plan); this catches a step built by hand
            raise QuantkitError(float_only_refusal(given))
        super().begin_layer(ctx)
        self._ctx = ctx
        self._stage_mates = {n: [m for m in stage if m != n] for stage in self.stages(ctx) for n in stage}

    def stages(self, ctx: LayerContext) -> list[list[str]]:
        if self.options["true_sequential"]:
            return ctx.adapter.sequential_stages(ctx.layer)
        return super().stages(ctx)

    def quantize_in_forward(self) -> bool:
        return bool(self.options["true_sequential"])  # the adapters' stages: q/k/v, o, gate/up, down

    def observe(self, name: str, module: nn.Module, x: torch.Tensor, reference: torch.Tensor | None = None) -> None:
        self._stats.observe(name, module.in_features, x, reference,
                            self._ctx.row_layout(name) if self._ctx is not None else None)

    def quantize_linear(self, name: str, module: nn.Linear, scheme: LinearScheme):
        if name in self._stacked:
            qw, self.layer_stats[name] = self._stacked.pop(name)
            return qw
        acc, cross = self._stats.pop(name)
        if acc is not None:
            acc.finish()  # counts over every rank, so every rank takes the same branch below
        if acc is not None and acc.n_samples == 0 and acc.n_dropped:
            # every calibration row reaching this linear held NaN/inf (one poisoned token spreads to the
            # whole sequence through attention): no Hessian to solve with, so round to nearest instead
            warnings.warn(f"GPTQ: all {acc.n_dropped} calibration rows for {name} contain NaN/inf; "
                          "quantizing it with RTN instead", RuntimeWarning, stacklevel=2)
            self.layer_stats[name] = {"fallback": "rtn", "dropped": acc.n_dropped}
            return self.quantize_uncalibrated(name, module, scheme)
        if acc is None or acc.n_samples == 0:
            raise QuantkitError(f"GPTQ saw no calibration inputs for {name}; check the dataset")
        # linears of this stage that share the Hessian and the scheme (q/k/v, gate/up) are solved as
        # one matrix: GPTQ treats every output row on its own given H, so the rows come out as from
        # separate solves, for one column loop instead of several (the loop is dispatch-bound)
        mates = [m for m in self._stage_mates.get(name, ()) if self._stats.hessians.get(m) is acc
                 and self._ctx.schemes.get(m) == scheme]
        linears = [(name, module)] + [(m, self._ctx.layer.get_submodule(m)) for m in mates]
        for m in mates:
            self._stats.pop(m)
        o = self.options
        weight = torch.cat([lin.weight.data for _, lin in linears]) if mates else module.weight.data
        H = acc.hessian().to(module.weight.device)
        if cross is not None:  # GPTAQ: GPTQ on the target that reproduces the unquantized model's output
            weight = asymmetric_target(weight, H, cross.cross().to(H.device), float(o["gptaq_alpha"]),
                                       float(o["damp_percent"]))
        # a GGUF type's blocks: parameters searched as llama-quantize does with an importance matrix,
        # H's diagonal being one (llama-imatrix's mean squared activation per input column, up to scale)
        grid = (None if scheme.grid is None
                else choose_grid(weight, ggml_type(scheme.grid), importance=torch.diagonal(H)))
        comm = self._ctx.samples.comm if self._ctx is not None and self._ctx.samples is not None else None
        qw, stats = self.solver.solve(
            comm, name, weight if grid is None else grid.shifted(weight), H, bits=scheme.bits, group_size=scheme.group_size,
            sym=scheme.sym, qparams=None if grid is None else (grid.scale, grid.zero),
            return_rounded=self.keep_rounded and grid is None, **self.solver_options(),
        )
        rounded = stats.pop("rounded", None)
        if grid is not None:  # the codes GPTQ chose on the fixed grid, with the grid's offsets and k-quant scales
            qw = grid.on_grid(qw.qweight)
        row_loss = stats.pop("row_loss")
        start = 0
        for n, lin in linears:
            rows = slice(start, start + lin.out_features)
            start = rows.stop
            part = replace(qw.select_rows(rows), bias=None if lin.bias is None else lin.bias.detach().clone())
            part_stats = {**stats, "loss": float(row_loss[rows].sum())}
            if rounded is not None:
                self._rounded[n] = rounded[rows].cpu()
            if mates:
                part_stats["solved_with"] = [m for m, _ in linears if m != n]
            self._stacked[n] = (part, part_stats)
        qw, self.layer_stats[name] = self._stacked.pop(name)
        return qw

    def rounded_weight(self, name: str) -> torch.Tensor | None:
        return self._rounded.get(name)

    def discard(self, name: str) -> None:
        self._rounded.pop(name, None)
        self._stats.pop(name)
        self._stacked.pop(name, None)

    def planned_spec(self, spec):
        order = act_order_kind(bool(self.options["desc_act"]), bool(self.options["static_groups"]), spec.group_size)
        return replace(spec, act_order=order)

    def end_layer(self, ctx: LayerContext) -> None:
        if self._stats.hessians:
            warnings.warn(f"GPTQ: discarded unused Hessians for {sorted(self._stats.hessians)}")
        if self._stacked:
            warnings.warn(f"GPTQ: discarded results never asked for: {sorted(self._stacked)}")
        self._stats.clear()
        self._stacked.clear()
        self._rounded.clear()
        self._ctx = None

    def format_extra(self) -> dict:
        o = self.options
        return {"desc_act": bool(o["desc_act"]), "static_groups": bool(o["static_groups"]),
                "true_sequential": bool(o["true_sequential"]), "damp_percent": float(o["damp_percent"])}
