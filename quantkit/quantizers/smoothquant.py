"""SmoothQuant (Xiao et al., 2023) with W8A8 int8 output, as a recipe transform.

Why: int8 activations break LLMs because a few input channels carry outliers 10-100x the rest,
always the same channels, so per-token scales cannot absorb them. SmoothQuant moves part of that
range into the weights, which are quantized per output channel and tolerate it. Per group of
linears fed by a norm (the adapter's ``input_groups`` of kind "norm": norm -> q/k/v, norm ->
gate/up, Phi-3's fused projections, OPT's LayerNorms -> q/k/v and -> fc1; linear -> linear groups
are left alone, as in the paper):

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)     (max|W_j| over column j of all the group's linears)

and ``fold_scales`` divides the norm by s and multiplies the weight columns by s (exact in full
precision). Per decoder layer, in ``begin_layer``:

1. one hooked calibration pass records max|x| per input channel of every group and, for
   ``alpha: auto``, the inputs of the group's block (``InputGroup.inspect``: attention, MLP, or
   OPT's fc1) for whole sequences up to ``search_tokens``;
2. ``alpha: auto``: for alpha in 0, step, ..., 1 the group is smoothed and fake-quantized W8A8
   (RTN int8 weights per channel, int8 inputs as configured) and the alpha with the lowest MSE of
   the block output against full precision wins (ties keep the smaller alpha);
3. the scales are folded.

The recipe's weight quantizer then quantizes the weights int8 symmetric per output channel: the
method `smoothquant` finishes with RTN, `smoothquant,gptq` (the bundled recipe
`smoothquant-gptq-w8a8`) with GPTQ, which sees the smoothed inputs. This step then gives every
`QuantizedWeight` its ``input_quant`` (``finalize``): dynamic per token, or (``activations:
static``) a per-tensor scale max|x|/127 over the calibration set of that linear's smoothed input
(observed in the weight quantizer's passes), rounded to fp16 like the weight scales. Alphas and
search losses are kept per layer in ``search_log``. ``smooth: false`` gives plain W8A8 (the
baseline smoothing is measured against); with dynamic activations and RTN it needs no calibration
data.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.layer_io import StopForward, batch_shapes, layer_output, slice_rows, to_device
from quantkit.models.base import NORM
from quantkit.models.folding import fold_scales
from quantkit.qtensor import QuantizedWeight
from quantkit.quantizers.base import LayerContext, Transform, register_step
from quantkit.quantizers.grid import SCALE_DTYPE, fake_quantize_grouped
from quantkit.reduction import SampleLayout
from quantkit.scheme import LinearScheme

W8 = LinearScheme(bits=8, group_size=-1, sym=True)
SCALE_MIN = 1e-5  # SmoothQuant's clamp of the weight maxima and of the scales



def smooth_scales(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's s = max|X|^a / max|W|^(1-a), clamped at 1e-5 (non-finite entries become 1)."""
    s = x_max.float().pow(alpha) / w_max.float().clamp(min=SCALE_MIN).pow(1 - alpha)
    s = s.clamp(min=SCALE_MIN)
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def fake_quant_input(x: torch.Tensor, static_amax: float | None = None) -> torch.Tensor:
    """int8 quantize-dequantize of an input as the W8A8 runtime does: per token, or per tensor."""
    xf = x.float()
    if static_amax is None:
        scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0
    else:
        scale = torch.full((), static_amax / 127.0, device=x.device)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (torch.round(xf / safe).clamp(-128, 127) * scale).to(x.dtype)


@register_step
class SmoothQuantTransform(Transform):
    name = "smoothquant"
    default_sym = True
    default_format = "compressed-tensors"
    default_scheme = {"bits": 8, "group_size": -1}
    quantizes_activations = True
    option_words = {"alpha": ("auto",)}
    options_spec = {
        "smooth": True,  # false: plain W8A8 (the baseline smoothing is measured against)
        "alpha": 0.5,  # migration strength in [0, 1], or "auto" (per-group search)
        "alpha_step": 0.1,  # grid step of the auto search
        "search_tokens": 2048,  # tokens (whole sequences) the auto search loss runs on; 0: all
        "activations": "dynamic",  # dynamic (int8 per token at run time) | static (calibrated per tensor)
    }

    def __init__(self, **options):
        super().__init__(**options)
        o = self.options
        alpha = o["alpha"]
        if isinstance(alpha, str) and alpha.strip().lower() == "auto":
            o["alpha"] = "auto"
        elif isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise QuantkitError(f"smoothquant option alpha must be a number in [0, 1] or 'auto', got {alpha!r}")
        step = o["alpha_step"]
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not 0 < step <= 1:
            raise QuantkitError(f"smoothquant option alpha_step must be in (0, 1], got {o['alpha_step']!r}")
        if isinstance(o["search_tokens"], bool) or not isinstance(o["search_tokens"], int) or o["search_tokens"] < 0:
            raise QuantkitError(f"smoothquant option search_tokens must be a non-negative integer, got {o['search_tokens']!r}")
        if o["activations"] not in ("dynamic", "static"):
            raise QuantkitError(f"smoothquant option activations must be dynamic or static, got {o['activations']!r}")
        # instance attributes (the recipe reads them): static input scales are observed in the weight
        # quantizer's passes; plain dynamic W8A8 looks at no data
        self.observes = o["activations"] == "static"
        self.needs_calibration = bool(o["smooth"]) or self.observes
        self._amax: dict[str, float] = {}  # linear -> max|x| of its (smoothed) input, static activations
        self._layout: SampleLayout | None = None  # the layer's calibration samples (every rank's: see finalize)
        self.search_log: dict[int, list[dict[str, Any]]] = {}

    def planned_spec(self, spec):
        from dataclasses import replace

        strategy = "tensor" if self.options["activations"] == "static" else "token"
        # per channel is one group: a weight quantizer's processing order (GPTQ act-order) leaves no trace
        return replace(spec, input_quant=strategy, act_order="none")

    def check_scheme(self, scheme) -> None:
        entries = [("scheme", scheme.bits, scheme.group_size, scheme.sym)]
        entries += [(f"override {o.pattern!r}", o.bits, o.group_size, o.sym) for o in scheme.overrides]
        for where, bits, group_size, sym in entries:
            if bits not in (None, 8):
                raise QuantkitError(f"smoothquant produces W8A8: bits must be 8, not {bits} ({where}); "
                                    "for 4-bit weights use gptq or awq")
            if group_size not in (None, -1):
                raise QuantkitError(f"smoothquant W8A8 uses per-channel weight scales: group_size must be -1, "
                                    f"not {group_size} ({where})")
            if sym is False:
                raise QuantkitError(f"smoothquant W8A8 is symmetric; drop --asym ({where})")

    # -- pipeline hooks ------------------------------------------------------------------
    def begin_layer(self, ctx: LayerContext) -> None:
        self._layout = ctx.samples or SampleLayout.of_batches(batch_shapes(ctx.inputs))
        layer = ctx.layer
        groups = [g for g in ctx.adapter.input_groups(layer, ctx.config)
                  if g.kind == NORM and any(n in ctx.schemes for n in g.linears)]
        log: list[dict[str, Any]] = []
        self.search_log[ctx.index] = log
        if not self.options["smooth"] or not groups or not ctx.inputs:
            return
        x_max, block_inputs = self._capture(ctx, groups)
        for g in groups:
            w_max = torch.stack([layer.get_submodule(n).weight.detach().abs().amax(dim=0).float()
                                 for n in g.linears]).amax(dim=0)
            xm = x_max[g.prev].to(w_max.device)
            entry: dict[str, Any] = {"prev": g.prev, "linears": g.linears}
            if self.options["alpha"] == "auto":
                entry["alpha"], entry["losses"] = self._search(ctx, g, xm, w_max, block_inputs[g.inspect])
            else:
                entry["alpha"] = float(self.options["alpha"])
            s = self._scales(xm, w_max, entry["alpha"])
            fold_scales(layer, g, s)
            entry["scales"] = s.cpu()
            log.append(entry)

    def observe(self, name: str, module: nn.Module, x: torch.Tensor) -> None:
        self._amax[name] = max(self._amax.get(name, 0.0), float(x.detach().abs().max()))

    def finalize(self, name: str, qw: QuantizedWeight) -> QuantizedWeight:
        if (qw.bits, qw.group_size, qw.sym) != (W8.bits, W8.group_size, W8.sym):
            raise QuantkitError(f"smoothquant quantizes W8A8 (8-bit symmetric per channel), got {qw.bits}-bit "
                                f"group {qw.group_size} for {name}")
        qw.act_order = "none"  # per channel is one group: the processing order leaves no trace
        if self.options["activations"] == "dynamic":
            qw.input_quant = {"strategy": "token", "dynamic": True}
        else:
            amax = self._layout.comm.max_(torch.tensor([self._amax.pop(name, -1.0)], dtype=torch.float64))
            if float(amax) < 0:
                raise QuantkitError(f"smoothquant saw no calibration inputs for {name}; check the dataset")
            tiny = torch.finfo(SCALE_DTYPE).tiny
            scale = torch.tensor([max(float(amax) / 127.0, tiny)]).to(SCALE_DTYPE).float()
            qw.input_quant = {"strategy": "tensor", "dynamic": False, "scale": scale}
        return qw

    def end_layer(self, ctx: LayerContext) -> None:
        self._amax.clear()

    # -- what the alpha search simulates (a subclass for another grid overrides these) ------
    def _alphas(self) -> list:
        """The migration strengths the auto search tries: 0, step, ..., 1."""
        step = float(self.options["alpha_step"])
        return sorted({min(1.0, round(i * step, 6)) for i in range(round(1 / step) + 1)})

    def _scales(self, x_max: torch.Tensor, w_max: torch.Tensor, alpha) -> torch.Tensor:
        return smooth_scales(x_max, w_max, alpha)

    def _fake_weight(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """The smoothed weight `w` (float32) as the finishing quantizer's grid rounds it: int8 per channel."""
        return fake_quantize_grouped(w, W8)

    def _fake_input(self, name: str, x: torch.Tensor, amax: float) -> torch.Tensor:
        """The smoothed input as the runtime quantizes it (`amax`: its calibrated max, for static scales)."""
        return fake_quant_input(x, amax if self.options["activations"] == "static" else None)

    # -- internals -------------------------------------------------------------------------
    @torch.no_grad()
    def _capture(self, ctx: LayerContext, groups) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
        """max|x| per channel of each group's input (keyed by prev) and, for the search, block inputs."""
        x_max: dict[str, torch.Tensor] = {}
        block_inputs: dict[str, list] = {}
        search = self.options["alpha"] == "auto"
        shapes, layout = batch_shapes(ctx.inputs), self._layout
        first_n = layout.leading_sequences(self.options["search_tokens"])
        calls: dict[str, int] = {}

        def amax_hook(prev):
            def hook(module, args):
                x = args[0].detach()
                m = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
                x_max[prev] = m if prev not in x_max else torch.maximum(x_max[prev], m)
            return hook

        def block_hook(name):
            def hook(module, args, kwargs):
                i = calls.get(name, 0)
                calls[name] = i + 1
                if i < len(shapes):  # whole sequences, in order, up to the token budget; cut at the leaves
                    b, t = shapes[i]
                    block_inputs.setdefault(name, []).extend(
                        (slice_rows(args, a, e, b, t), slice_rows(kwargs, a, e, b, t))
                        for a, e in layout.leading_pieces(i, first_n))
            return hook

        def stop_when_all_seen(module, args):
            seen.add(module)
            if len(seen) == len(hooked):
                raise StopForward  # the rest of the layer (most of the MLP) is not needed

        # where each group's input is read: its first linear, or a MoE block itself (an expert sees only its tokens)
        hooked = {ctx.layer.get_submodule(g.input_module) for g in groups}
        handles = [ctx.layer.get_submodule(g.input_module).register_forward_pre_hook(amax_hook(g.prev)) for g in groups]
        if search:
            handles += [ctx.layer.get_submodule(n).register_forward_pre_hook(block_hook(n), with_kwargs=True)
                        for n in sorted({g.inspect for g in groups})]
        handles += [m.register_forward_pre_hook(stop_when_all_seen) for m in hooked]  # after the others
        seen: set = set()
        params = next(ctx.layer.parameters())
        try:
            for hidden, kwargs in ctx.inputs:
                seen.clear()
                try:
                    ctx.layer(hidden.to(device=params.device, dtype=params.dtype), **to_device(kwargs, params.device))
                except StopForward:
                    pass
        finally:
            for h in handles:
                h.remove()
        for prev in sorted({g.prev for g in groups}):  # the maxima over every rank's samples
            layout.comm.max_(x_max[prev])
        return x_max, block_inputs

    @torch.no_grad()
    def _search(self, ctx: LayerContext, group, x_max: torch.Tensor, w_max: torch.Tensor, batches: list):
        """Alpha with the lowest block-output MSE when the group is smoothed and fake-quantized as the finished
        checkpoint runs (`_fake_weight`, `_fake_input`: W8A8 here)."""
        layer = ctx.layer
        block = layer.get_submodule(group.inspect)
        linears = {n: layer.get_submodule(n) for n in group.linears}
        originals = {n: m.weight.data.clone() for n, m in linears.items()}
        run = lambda: [layer_output(block(*a, **k)).float() for a, k in batches]  # noqa: E731
        reference, comm = run(), self._layout.comm
        numel, = comm.sum_ints([sum(r.numel() for r in reference)])
        alphas = self._alphas()
        losses, best = [], (math.inf, None)
        state = {}

        def input_hook(name):
            def hook(module, args):
                x = args[0] / state["s"].to(args[0].dtype)
                if name in ctx.schemes:
                    x = self._fake_input(name, x, state["amax"])
                return (x, *args[1:])
            return hook

        handles = [m.register_forward_pre_hook(input_hook(n)) for n, m in linears.items()]
        try:
            for alpha in alphas:
                s = self._scales(x_max, w_max, alpha)
                state["s"] = s
                state["amax"] = float((x_max / s).max())
                for n, m in linears.items():
                    w = originals[n].float() * s.view(1, -1)
                    m.weight.data = (self._fake_weight(n, w) if n in ctx.schemes else w).to(m.weight.dtype)
                loss = comm.ordered_sum([float((o - r).pow(2).sum()) for o, r in zip(run(), reference)]) / max(1, numel)
                losses.append(loss)
                if loss < best[0]:
                    best = (loss, alpha)
        finally:
            for h in handles:
                h.remove()
            for n, m in linears.items():
                m.weight.data = originals[n]
        if not math.isfinite(best[0]):
            raise QuantkitError(f"smoothquant: the alpha search for {group.linears} produced no finite loss; "
                                "the calibration data or weights contain NaN/inf")
        return best[1], dict(zip(alphas, losses))
