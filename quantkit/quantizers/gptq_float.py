"""GPTQ on the float grids of the compressed-tensors presets (#47): FP8 (E4M3), NVFP4 and MXFP4 (E2M1).

The column solve is GPTQ's (Frantar et al.; the blocked form with lazy updates, act-order by the Hessian's
diagonal): each column is rounded, its error spread over the columns not yet rounded through the inverse
Hessian's Cholesky factor. What differs from the integer solver (`gptq_core`) is the grid: a column is rounded
to the nearest E4M3 / E2M1 value of w / scale, and the scales are the format's own, fixed from the original
weight before the solve (`float_codecs.fixed_grid`: FP8 absmax / 448 per channel or block; NVFP4's E4M3 group
scales under the global scale, shared by fused siblings; MXFP4's E8M0 exponents; each with round-to-nearest's
range search where on, option `mse`, its error weighted by the Hessian's diagonal, option `weighted_search`),
as static groups fix integer scales. So the file holds exactly the format compressed-tensors defines, and only the codes move.

`FloatGPTQ` is the step quantkit's layer-by-layer pipeline runs (`pipeline.quantize_model`: the same
calibration flow as integer GPTQ, true-sequential, MoE experts on their routed tokens); its results are
`FloatResult`s, which the pipeline fake-quantizes with and `float_checkpoint` writes.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.float_codecs import activations, scale_search
from quantkit.float_codecs.fixed_grid import FixedFloatGrid, fixed_grid
from quantkit.float_codecs.fused_global_scale import shared_global_scales
from quantkit.float_codecs.result import FloatResult
from quantkit.quantizers.base import LayerContext, Quantizer
from quantkit.quantizers.gptq_core import (LayerInputStatistics, act_order_permutation, asymmetric_target,
                                           check_gptaq_alpha, checked_float32_copies, damped_inverse_cholesky,
                                           zero_dead_inputs_)
from quantkit.scheme import LinearScheme
from quantkit.scheme_presets import QuantArgs


# presets whose GPTQ rounds its Hessian's inputs by default (`input_rounding`), by input activation scheme
# (kind, bits, strategy): measured on the demo, docs/float-schemes.md
INPUT_ROUNDING_DEFAULT_ON = {("float", 4, "tensor_group"), ("float", 4, "group")}  # NVFP4, MXFP4


def _rounded_inputs(acts: Optional[QuantArgs], asked: Optional[bool]) -> Optional[QuantArgs]:
    """The activation scheme GPTQ rounds its inputs onto (None: it does not), from the option and the preset."""
    if asked is not None and not isinstance(asked, bool):
        raise QuantkitError(f"option input_rounding={asked!r} must be true or false")
    if acts is None or asked is False:
        if asked:
            raise QuantkitError("option input_rounding=true: this preset leaves its inputs unquantized (a weight-only "
                                "scheme); there is nothing to round")
        return None
    if not activations.rounds_without_scales(acts):
        if asked:
            raise QuantkitError("option input_rounding=true: a static per-tensor FP8 input scale is fixed by the "
                                "whole calibration set, so GPTQ cannot round its inputs as the runtime will; "
                                "use FP8_DYNAMIC or leave the option off")
        return None
    if asked is None and (acts.kind, acts.bits, acts.strategy) not in INPUT_ROUNDING_DEFAULT_ON:
        return None
    return acts


@torch.no_grad()
def gptq_on_float_grid(weight: torch.Tensor, H: torch.Tensor, grid: FixedFloatGrid, block_size: int = 128,
                       damp_percent: float = 0.01, act_order: bool = True) -> tuple[torch.Tensor, dict]:
    """GPTQ of weight [N, K] given the input Hessian H [K, K], every column rounded on `grid`. Returns the
    float32 weight it chose (every element on the grid) and stats (loss: sum of err^2 / 2, damp, dead, seconds).

    The checks, dead inputs, act-order and damped inverse are the integer solver's (`gptq_core`); the column
    loop is its own: the grid is fixed before the solve, so it has none of `gptq_core._solve_columns`'
    groups formed mid-solve (and keeps its own summation order, hence its bytes)."""
    t0 = time.perf_counter()
    n, k = weight.shape
    if tuple(H.shape) != (k, k):
        raise ValueError(f"Hessian shape {tuple(H.shape)} does not match in_features {k}")
    W, H = checked_float32_copies(weight, H)
    n_dead = zero_dead_inputs_(W, H)
    perm = act_order_permutation(H) if act_order else torch.arange(k)
    W, H = W[:, perm], H[perm][:, perm]
    Hinv, pct, mean_diag = damped_inverse_cholesky(H, damp_percent, n_dead)
    cols = perm.tolist()
    WT = W.t().contiguous()  # [K, N]: a column is a contiguous row (the loop is dispatch-bound)
    QT = torch.empty_like(WT)
    loss = 0.0
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = WT[i1:i2].clone()
        Err1 = torch.empty_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w = W1[i]
            q = grid.round_column(w, cols[i1 + i])
            QT[i1 + i] = q
            err = (w - q).div_(Hinv1[i, i])
            W1[i:].addr_(Hinv1[i, i:], err, alpha=-1.0)
            Err1[i] = err
        loss += float(Err1.square().sum()) / 2
        if i2 < k:
            WT[i2:].addmm_(Hinv[i1:i2, i2:].t(), Err1, alpha=-1.0)
    w_hat = torch.empty_like(W)
    w_hat[:, perm] = QT.t()
    return w_hat, {"loss": loss, "damp": pct * mean_diag, "dead": n_dead,
                   "seconds": time.perf_counter() - t0}


class FloatGPTQ(Quantizer):
    """GPTQ onto a float preset's weight grid (see the module docstring). Not a registered method: the float
    presets' writer (`float_checkpoint.write(method="gptq")`) builds it with the preset's weights args."""

    name = "gptq"
    calibration_stream = "quantized"
    # mse: round-to-nearest's range search picks the fixed scales (`float_codecs.scale_search`); None: GPTQ's
    # default for the format (`scale_search.GPTQ_DEFAULT_ON`: on for NVFP4 and MXFP4)
    # gptaq: GPTQ towards the unquantized model's output from the quantized model's inputs, as the integer
    # solver's option (`gptq_core.asymmetric_target`; the format's scales stay fixed from the original weight)
    # weighted_search: the range search weighs each weight's rounding error by its input's mean square (the
    # Hessian's diagonal), as the layer's output error does (NVFP4A16 on the demo: KL -19 % lee, -22 % wiki)
    # input_rounding (presets that quantize their inputs): the Hessian from the inputs as the runtime rounds them
    # onto the preset's activation grid (`activations.fake_quantize_split_free`), so GPTQ matches the weights'
    # output on the inputs the weights will meet; input_rounding_alpha > 0 also moves the target towards the
    # unrounded inputs' output W x (GPTAQ's asymmetric problem with the rounded input as x_q, one more [K, K]
    # statistic per input); None: on where measured (INPUT_ROUNDING_DEFAULT_ON)
    options_spec = {"damp_percent": 0.01, "block_size": 128, "desc_act": True, "true_sequential": True, "mse": None,
                    "weighted_search": True, "gptaq": False, "gptaq_alpha": 0.25, "input_rounding": None,
                    "input_rounding_alpha": 0.0}

    def __init__(self, weights: QuantArgs, input_activations: Optional[QuantArgs] = None, **options):
        super().__init__(**options)
        if not 0 < float(self.options["damp_percent"]) < 1:
            raise QuantkitError(f"damp_percent must be in (0, 1), got {self.options['damp_percent']}")
        if int(self.options["block_size"]) < 1:
            raise QuantkitError(f"block_size must be positive, got {self.options['block_size']}")
        if self.options["mse"] is not None and not isinstance(self.options["mse"], bool):
            raise QuantkitError(f"option mse={self.options['mse']!r} must be true or false")
        if not isinstance(self.options["gptaq"], bool):
            raise QuantkitError(f"option gptaq={self.options['gptaq']!r} must be true or false")
        check_gptaq_alpha(self.options["gptaq_alpha"])
        self.needs_reference_inputs = self.options["gptaq"]  # an instance attribute: the recipe reads it
        self.weights = weights
        self.input_activations = _rounded_inputs(input_activations, self.options["input_rounding"])
        alpha = self.options["input_rounding_alpha"]
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise QuantkitError(f"input_rounding_alpha must be a number in [0, 1], got {alpha!r}")
        if alpha > 0 and self.options["gptaq"]:
            raise QuantkitError("input_rounding_alpha moves GPTQ's target towards the unrounded input's output, gptaq "
                                "towards the unquantized model's: give one of them")
        self._input_target = self.input_activations is not None and alpha > 0
        self._stats = LayerInputStatistics(with_cross=self.needs_reference_inputs or self._input_target)
        self._rounded: tuple = (None, None)
        self._stage_mates: dict[str, list[str]] = {}
        self._stacked: dict[str, FloatResult] = {}
        self._global_scales: dict[str, torch.Tensor] = {}
        self._ctx: Optional[LayerContext] = None
        # {linear: absmax of every input observed}, when the writer asks (`record_input_absmax`): a preset's
        # static input scales from the very inputs GPTQ calibrates on, the quantized model's (as llm-compressor's
        # sequential pipeline observes them), without a forward of their own
        self.input_absmax: Optional[dict[str, torch.Tensor]] = None

    def record_input_absmax(self) -> None:
        """From now on keep each observed linear's input absmax in `input_absmax` (keyed by full name)."""
        self.input_absmax = {}

    def begin_layer(self, ctx: LayerContext) -> None:
        self._ctx = ctx
        self._stage_mates = {n: [m for m in stage if m != n] for stage in self.stages(ctx) for n in stage}
        # NVFP4: fused siblings share one global scale, from their original weights (before any is rounded)
        self._global_scales = (shared_global_scales(ctx.layer, set(ctx.schemes))
                               if self.weights.strategy == "tensor_group" else {})

    def stages(self, ctx: LayerContext) -> list[list[str]]:
        if self.options["true_sequential"]:
            return ctx.adapter.sequential_stages(ctx.layer)
        return super().stages(ctx)

    def quantize_in_forward(self) -> bool:
        return bool(self.options["true_sequential"])

    def observe(self, name: str, module: nn.Module, x: torch.Tensor, reference: torch.Tensor | None = None) -> None:
        if self.input_absmax is not None and x.numel():
            key = (self._ctx.prefix if self._ctx is not None else "") + name
            amax = x.detach().abs().amax().to(device="cpu", dtype=torch.float32)
            self.input_absmax[key] = torch.maximum(self.input_absmax[key], amax) if key in self.input_absmax else amax
        if self.input_activations is not None and x.numel():
            x, reference = self._rounded_input(x), (x if self._input_target else reference)
        self._stats.observe(name, module.in_features, x, reference, self._ctx.row_layout(name) if self._ctx else None)

    def _rounded_input(self, x: torch.Tensor) -> torch.Tensor:
        """x rounded as the runtime rounds it (one tensor per input: q/k/v share theirs, as their Hessian)."""
        if x is not self._rounded[0]:
            self._rounded = (x, activations.fake_quantize_split_free(x.detach(), self.input_activations))
        return self._rounded[1]

    def _grid(self, name: str, weight: torch.Tensor, importance: Optional[torch.Tensor] = None) -> FixedFloatGrid:
        search = scale_search.enabled(self.weights, self.options["mse"], scale_search.GPTQ_DEFAULT_ON)
        return fixed_grid(weight, self.weights, self._global_scales.get(name), search=search, importance=importance)

    def quantize_linear(self, name: str, module: nn.Linear, scheme: LinearScheme) -> FloatResult:
        if name in self._stacked:
            return self._stacked.pop(name)
        acc, cross = self._stats.pop(name)
        self._rounded = (None, None)  # its inputs are all observed (as its mates'): the rounded copy can go
        if acc is not None:
            acc.finish()
        if acc is None or acc.n_samples == 0:
            if acc is not None and acc.n_dropped:  # every row reaching it was NaN/inf: round to nearest
                return self.quantize_uncalibrated(name, module, scheme)
            raise QuantkitError(f"GPTQ saw no calibration inputs for {name}; check the dataset")
        # stage mates reading the same input are solved as one matrix (GPTQ treats rows independently)
        mates = [m for m in self._stage_mates.get(name, ()) if self._stats.hessians.get(m) is acc]
        linears = [(name, module)] + [(m, self._ctx.layer.get_submodule(m)) for m in mates]
        for m in mates:
            self._stats.pop(m)
        H = acc.hessian()
        # the range search (where on) weighs each weight's rounding error by its input's mean square
        importance = torch.diagonal(H) if self.options["weighted_search"] else None
        grids = [self._grid(n, lin.weight.data, importance) for n, lin in linears]  # the format's scales
        grid = grids[0] if len(grids) == 1 else FixedFloatGrid(grids[0].rtn, torch.cat([g.step for g in grids]))
        weight = torch.cat([lin.weight.data for _, lin in linears]).float()
        o = self.options
        H = H.to(weight.device)
        if cross is not None:  # GPTAQ: GPTQ on the target that reproduces the unquantized model's output
            alpha = o["input_rounding_alpha"] if self._input_target else o["gptaq_alpha"]
            weight = asymmetric_target(weight, H, cross.cross().to(H.device), float(alpha),
                                       float(o["damp_percent"]))
        w_hat, stats = gptq_on_float_grid(weight, H, grid, int(o["block_size"]), float(o["damp_percent"]),
                                          bool(o["desc_act"]))
        start = 0
        for (n, lin), g in zip(linears, grids):
            rows = slice(start, start + lin.out_features)
            start = rows.stop
            bias = None if lin.bias is None else lin.bias.detach().clone()
            self._stacked[n] = FloatResult(g.encode(w_hat[rows].contiguous()), bias, stats, self._absmax(n))
        return self._stacked.pop(name)

    def quantize_uncalibrated(self, name: str, module: nn.Linear, scheme: LinearScheme) -> FloatResult:
        """Round to nearest under the format's scales (a MoE expert too few tokens reached)."""
        self.discard(name)
        bias = None if module.bias is None else module.bias.detach().clone()
        return FloatResult(self._grid(name, module.weight.data).rtn, bias, {"fallback": "rtn"}, self._absmax(name))

    def round_to_nearest(self, module: nn.Linear, scheme: LinearScheme) -> FloatResult:
        bias = None if module.bias is None else module.bias.detach().clone()
        return FloatResult(self._grid("", module.weight.data).rtn, bias)

    def discard(self, name: str) -> None:
        self._stats.pop(name)
        self._stacked.pop(name, None)

    def _absmax(self, name: str) -> Optional[torch.Tensor]:
        """With `record_input_absmax`, the input absmax of `name` (relative to the layer) for its result to carry
        (every input of a linear is observed before it is quantized, as its Hessian is): the progress store keeps
        it with the result, so a resumed run has it, and a refiner's result takes it over."""
        if self.input_absmax is None:
            return None
        mine = self.input_absmax.get((self._ctx.prefix if self._ctx is not None else "") + name)
        comm = self._ctx.samples.comm if self._ctx is not None and self._ctx.samples is not None else None
        if comm is None or comm.world == 1:
            return mine
        # data-parallel: each rank saw its share of the samples; the maximum over all of them, on every rank
        # (every rank quantizes the same linears in the same order, so the collectives pair up)
        seen = torch.zeros(1, dtype=torch.float32) if mine is None else mine.reshape(1).clone()
        return comm.max_(seen).reshape(())

    def end_layer(self, ctx: LayerContext) -> None:
        self._stats.clear()
        self._rounded = (None, None)
        self._stacked.clear()
        self._global_scales = {}
        self._ctx = None
