"""How much each linear's quantization costs in KL, per candidate scheme: measured and predicted.

The expensive truth is the KL increase on held-out text when one module alone is quantized (all
else in full precision). Measuring it for every linear and scheme is a model forward each, so:

- the *proxy* for every (linear, scheme): the Hessian-weighted quantization error
  tr(dW H dW^T), H = 2/n X^T X of the linear's full-precision inputs on the calibration set (GPTQ's
  own objective: twice the mean squared output error per token), dW what the recipe's weight
  quantizer (GPTQ or RTN, alone, on that H) leaves;
- *measured* KL for every decoder layer (all its linears quantized at one scheme at once) and
  for a sample of single linears;
- predicted KL of (linear, scheme) = proxy x the factor that maps the layer's summed proxy onto its
  measured KL at that scheme ("layer" calibration; without layer measurements, one factor per scheme
  fitted on the sampled linears: "scheme"). The sampled single linears are then an independent
  check of the prediction (they are not used by "layer" calibration).

A mixture's predicted KL is the sum of its linears' predicted increments: an additivity assumption
(KL is locally quadratic in the logit change and the modules' errors are roughly independent),
which the allocation bench measures (scripts/bench_allocation.py).
"""
from __future__ import annotations

import math
import random
import re
import time
from dataclasses import replace
from typing import Any, Callable, Optional

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.scheme import LinearScheme, check_bits, check_group_size_value

CANDIDATE_BITS = (2, 3, 4, 8)


def scheme_label(s: LinearScheme) -> str:
    return f"w{s.bits}" + ("pc" if s.group_size == -1 else f"g{s.group_size}") + ("" if s.sym else "a")


def parse_candidate(candidate, base: LinearScheme) -> LinearScheme:
    """One candidate: a bit width (the linear's own group size and symmetry at it) or a scheme label
    such as w4g128, w8pc or w3g64a (a trailing a: asymmetric; else the linear's symmetry)."""
    if isinstance(candidate, int) and not isinstance(candidate, bool):
        return replace(base, bits=candidate)
    m = re.fullmatch(r"w(\d+)(?:g(\d+)|(pc))?(a?)", str(candidate).strip().lower())
    if m is None:
        raise QuantkitError(f"candidate scheme {candidate!r}: give a bit width (4) or a label such as w4g128, w8pc "
                            "or w3g64a (a: asymmetric)")
    group = -1 if m.group(3) else int(m.group(2)) if m.group(2) else base.group_size
    check_bits(int(m.group(1)))
    check_group_size_value(group)
    return replace(base, bits=int(m.group(1)), group_size=group, sym=base.sym and not m.group(4))


def candidates_for(base: LinearScheme, bits=CANDIDATE_BITS) -> tuple[LinearScheme, ...]:
    """The candidate schemes of a linear: `bits` entries are bit widths or scheme labels (parse_candidate)."""
    out = []
    for c in bits:
        s = parse_candidate(c, base)
        if s not in out:
            out.append(s)
    return tuple(out)


def layer_of(name: str, layers_prefix: str) -> Optional[int]:
    m = re.match(re.escape(layers_prefix) + r"\.(\d+)\.", name)
    return int(m.group(1)) if m else None


@torch.no_grad()
def capture_hessians(model: nn.Module, names: list[str], input_ids: torch.Tensor, batch_size: int,
                     progress: Callable[[str], None] = lambda s: None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """H = 2/n X^T X of every named linear's full-precision inputs over the calibration ids (one pass).

    Linears fed the very same input tensor (q/k/v, gate/up) share one Hessian: returns
    ({owner: H}, {linear: its owner})."""
    from quantkit.quantizers.gptq_core import HessianAccumulator

    modules = dict(model.named_modules())
    accs: dict[str, HessianAccumulator] = {}
    owner: dict[str, str] = {}
    last: dict[str, Any] = {"x": None, "name": None}

    def hook(name, x):
        if name not in owner:  # first batch: share the previous linear's sum if it saw this very tensor
            shared = last["x"] is x
            owner[name] = last["name"] if shared else name
            if not shared:
                accs[name] = HessianAccumulator(modules[name].in_features)
        if owner[name] == name:
            accs[name].add_batch(x)
        last["x"], last["name"] = x, owner[name]

    hooks = [modules[n].register_forward_pre_hook(lambda m, args, n=n: hook(n, args[0])) for n in names]
    try:
        for start in range(0, input_ids.shape[0], batch_size):
            progress(f"calibration batch {start // batch_size + 1}/{math.ceil(input_ids.shape[0] / batch_size)}")
            model(input_ids=input_ids[start:start + batch_size], use_cache=False)
            last["x"] = None
    finally:
        for h in hooks:
            h.remove()
    missing = [n for n in names if n not in owner]
    if missing:
        raise QuantkitError(f"no calibration input reached {missing[0]}; check the dataset")
    return {n: a.hessian() for n, a in accs.items()}, owner


def quantized_weight(quantizer, weight: torch.Tensor, H: torch.Tensor, scheme: LinearScheme) -> torch.Tensor:
    """`weight` as the recipe's weight quantizer leaves it at `scheme` (GPTQ on H, else RTN), dequantized."""
    from quantkit.quantizers.gptq_core import gptq_quantize
    from quantkit.quantizers.grid import rtn_quantize

    if quantizer.name == "gptq":
        _, stats = gptq_quantize(weight, H, scheme.bits, scheme.group_size, scheme.sym, return_dequant=True,
                                 **quantizer.solver_options())
        return stats["dequant"].to(weight.dtype)
    return rtn_quantize(weight, scheme.bits, scheme.group_size, scheme.sym,
                        **quantizer.uncalibrated_grid_options()).dequantize().to(weight.dtype)


def hessian_error(weight: torch.Tensor, approx: torch.Tensor, H: torch.Tensor) -> float:
    """tr(dW H dW^T): the summed mean squared output error (x2) the calibration inputs would see."""
    d = (approx.float() - weight.float())
    return float(((d @ H) * d).sum())


class KLMeter:
    """Mean KL(full precision || model) per scored token over fixed held-out windows.

    The full-precision hidden states entering every decoder layer are kept, so a measurement whose
    replaced linears all sit in layer i runs layers i.. only (half the model on average); the
    full-precision side's last hidden states are kept too, its logits recomputed by the head."""

    def __init__(self, model: nn.Module, adapter, windows: torch.Tensor, batch_size: int):
        from quantkit.layer_io import layer_output
        from quantkit.pipeline.capture import capture_layer_inputs

        self.model, self.adapter, self.windows = model, adapter, windows
        self.layers = adapter.decoder_layers(model)
        self.post = [m for _, m in adapter.post_layers(model)]
        self.head = adapter.lm_head(model)[1]
        self.prefix = adapter.layers_prefix(model)
        self.forwards = 0
        cpu = torch.device("cpu")
        inputs = capture_layer_inputs(model, adapter, windows, batch_size, cpu, cpu)
        self.kwargs = [kw for _, kw in inputs]
        self.states = [[h for h, _ in inputs]]  # states[i]: per batch, the hidden states entering layer i
        for layer in self.layers:
            self.states.append([layer_output(layer(h, **kw)) for h, kw in zip(self.states[-1], self.kwargs)])
        self.base_logp = [self._logp(h) for h in self.states[-1]]  # the full-precision side, computed once

    def _logp(self, hidden: torch.Tensor) -> torch.Tensor:
        """Log-probabilities in float64: a nearly lossless scheme's KL (8 bits on a small model) sits near
        float32's rounding of log_softmax, where a float32 KL came out negative and summed below zero."""
        for m in self.post:
            hidden = m(hidden)
        return torch.log_softmax(self.head(hidden)[:, :-1].double(), dim=-1)

    def _from_layer(self, first: int) -> list[torch.Tensor]:
        from quantkit.layer_io import layer_output

        out = []
        for b, kw in enumerate(self.kwargs):
            h = self.states[first][b]
            for layer in self.layers[first:]:
                h = layer_output(layer(h, **kw))
            out.append(h)
        return out

    @torch.no_grad()
    def kl_with(self, replaced: dict[str, torch.Tensor]) -> float:
        """KL with the named linears' weights replaced (restored afterwards)."""
        modules = dict(self.model.named_modules())
        indices = [layer_of(n, self.prefix) for n in replaced]
        first = 0 if any(i is None for i in indices) else min(indices)
        saved = {n: modules[n].weight.data for n in replaced}
        try:
            for n, w in replaced.items():
                modules[n].weight.data = w
            self.forwards += 1
            finals = self._from_layer(first) if first < len(self.layers) else self.states[-1]
        finally:
            for n, w in saved.items():
                modules[n].weight.data = w
        total, count = 0.0, 0
        for b, h in enumerate(finals):
            base = self.base_logp[b]
            ours = self._logp(h)
            kl = (base.exp() * (base - ours)).sum(-1)
            total, count = total + float(kl.sum()), count + kl.numel()
        return total / count


def measure(model: nn.Module, adapter, candidates: dict[str, tuple[LinearScheme, ...]], quantizer,
            calibration_ids: torch.Tensor, eval_windows: torch.Tensor, *, batch_size: int = 4, sample: int = 8,
            measure_layers: bool = True, measure_linears: bool = False, anchors: Optional[tuple[str, ...]] = None,
            seed: int = 0,
            progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The sensitivity table of `model` (fp32, in memory): proxies, measurements, predictions, the check.

    `measure_linears`: every linear measured alone at the `anchors` schemes (default: all its candidates),
    and its KL at another scheme predicted from its own measured KL per unit of proxy (calibration
    "linear", see per_linear_prediction); no layer runs; the sampled linears are then measured at the
    other schemes, as an out-of-sample check of that per-linear mapping. Always measured: the whole model
    at every uniform scheme (`whole_kl`, the points of the interaction mapping). The returned
    `kl_of_mixture` scores any {linear: scheme label} on the same windows (the mixture check)."""
    t0 = time.perf_counter()
    layers_prefix = adapter.layers_prefix(model)
    names = list(candidates)
    hessians, owner = capture_hessians(model, names, calibration_ids, batch_size, progress)
    modules = dict(model.named_modules())
    first_of = {}
    for c in candidates.values():
        for s in c:
            first_of.setdefault(scheme_label(s), s)
    # by bits, then larger groups first (per channel last), for the tables and pictures
    labels = sorted(first_of, key=lambda l: (first_of[l].bits, first_of[l].group_size == -1,
                                             -first_of[l].group_size))
    approx: dict[tuple[str, str], torch.Tensor] = {}
    proxy: dict[tuple[str, str], float] = {}
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(owner[n], []).append(n)
    for i, (first, members) in enumerate(groups.items()):
        progress(f"proxy {i + 1}/{len(groups)}: {', '.join(members)}")
        H = hessians.pop(first)
        for label in {scheme_label(s) for n in members for s in candidates[n]}:
            # linears sharing H and the scheme solved as one stacked matrix (GPTQ treats rows
            # independently given H), as the GPTQ step does
            mates = [n for n in members if any(scheme_label(s) == label for s in candidates[n])]
            s = next(s for s in candidates[mates[0]] if scheme_label(s) == label)
            w = torch.cat([modules[n].weight.data for n in mates])
            q = quantized_weight(quantizer, w, H, s)
            row = 0
            for n in mates:
                rows = slice(row, row + modules[n].out_features)
                row = rows.stop
                approx[(n, label)] = q[rows].contiguous()
                proxy[(n, label)] = hessian_error(w[rows], q[rows], H)
        del H

    meter = KLMeter(model, adapter, eval_windows, batch_size)
    by_layer: dict[int, list[str]] = {}
    for n in names:
        by_layer.setdefault(layer_of(n, layers_prefix), []).append(n)
    layer_kl: dict[tuple[int, str], float] = {}
    measured: dict[tuple[str, str], float] = {}
    if measure_linears:
        measure_layers = False
        for i, n in enumerate(names):
            at = [scheme_label(s) for s in candidates[n] if anchors is None or scheme_label(s) in anchors]
            progress(f"linear {i + 1}/{len(names)} {n} at {', '.join(at)}")
            for label in at:
                measured[(n, label)] = meter.kl_with({n: approx[(n, label)]})
    anchored = dict(measured)
    whole_kl = {}
    for label in labels:
        if all((n, label) in approx for n in names):
            progress(f"whole model at {label}")
            whole_kl[label] = meter.kl_with({n: approx[(n, label)] for n in names})
    if measure_layers:
        for index, members in sorted(by_layer.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
            for label in labels:
                if all((n, label) in approx for n in members):
                    progress(f"layer {index} at {label}")
                    layer_kl[(index, label)] = meter.kl_with({n: approx[(n, label)] for n in members})
    rng = random.Random(seed)
    sampled = sorted(rng.sample(names, min(sample, len(names))), key=names.index)
    for n in sampled:
        for s in candidates[n]:
            if (n, scheme_label(s)) in measured:
                continue
            progress(f"linear {n} at {scheme_label(s)}")
            measured[(n, scheme_label(s))] = meter.kl_with({n: approx[(n, scheme_label(s))]})
    if measure_linears:
        factors, mode = {}, "linear"
        predicted = per_linear_prediction(proxy, anchored)
        check_keys = {k: v for k, v in measured.items() if k not in anchored}  # out of sample
    else:
        factors, mode = _calibrate(proxy, by_layer, layer_kl, measured, labels)
        predicted = {(n, l): proxy[(n, l)] * factors[(layer_of(n, layers_prefix), l)]
                     for (n, l) in proxy}

    def kl_of_mixture(choice: dict[str, str]) -> float:
        return meter.kl_with({n: approx[(n, label)] for n, label in choice.items()})

    return {"proxy": proxy, "predicted": predicted, "measured": measured, "layer_kl": layer_kl,
            "whole_kl": whole_kl, "kl_of_mixture": kl_of_mixture,
            "calibration_mode": mode, "factors": factors, "labels": labels, "by_layer": by_layer,
            "check": (proxy_check(check_keys, predicted, proxy, in_sample=False) if mode == "linear"
                      else proxy_check(measured, predicted, proxy, in_sample=mode == "scheme")),
            "forwards": meter.forwards, "seconds": round(time.perf_counter() - t0, 1)}


def per_linear_prediction(proxy: dict, anchored: dict) -> dict:
    """Predicted KL of every (linear, scheme): measured where it was (the anchors), else the proxy times
    the linear's own measured KL per unit of proxy, interpolated in log proxy between its anchors
    (the nearest anchor's ratio beyond them). One mapping per linear, not one per scheme: the
    proxy -> KL ratio differs by decades across linears (outlier inputs, position in the network)
    but little across the schemes of one linear."""
    ratios: dict[str, list[tuple[float, float]]] = {}
    for (n, label), kl in anchored.items():
        if proxy[(n, label)] > 0 and kl > 0:
            ratios.setdefault(n, []).append((math.log(proxy[(n, label)]), math.log(kl / proxy[(n, label)])))
    # a linear whose anchors measured no KL above zero (below float resolution): the median ratio
    every = sorted(r for pts in ratios.values() for _, r in pts)
    fallback = [(0.0, every[len(every) // 2])] if every else []
    out = {}
    for (n, label), p in proxy.items():
        if (n, label) in anchored:
            out[(n, label)] = anchored[(n, label)]
            continue
        pts = sorted(ratios.get(n, fallback))
        if not pts or p <= 0:
            out[(n, label)] = 0.0 if p <= 0 else math.nan
            continue
        x = math.log(p)
        if x <= pts[0][0] or len(pts) == 1:
            r = pts[0][1] if x <= pts[0][0] else pts[-1][1]
        elif x >= pts[-1][0]:
            r = pts[-1][1]
        else:
            j = max(i for i in range(len(pts) - 1) if pts[i][0] <= x)
            (x0, r0), (x1, r1) = pts[j], pts[j + 1]
            r = r0 + (r1 - r0) * (x - x0) / (x1 - x0)
        out[(n, label)] = p * math.exp(r)
    missing = sorted({n for (n, _), v in out.items() if math.isnan(v)})
    if missing:
        raise QuantkitError(f"{missing[0]}: no linear measured a KL above zero at its anchor schemes to calibrate "
                            "the proxy; measure at more schemes (--measure-at) or on more held-out tokens")
    return out


def _calibrate(proxy, by_layer, layer_kl, measured, labels):
    """(layer, scheme label) -> KL per unit of proxy, and how it was fitted."""
    if layer_kl:
        factors = {}
        for index, members in by_layer.items():
            for label in labels:
                total = sum(proxy.get((n, label), 0.0) for n in members)
                kl = layer_kl.get((index, label))
                factors[(index, label)] = max(kl, 0.0) / total if kl is not None and total > 0 else math.nan
        # a layer without its measurement (or zero proxy): the median factor of that scheme
        for label in labels:
            known = sorted(f for (i, l), f in factors.items() if l == label and math.isfinite(f))
            fill = known[len(known) // 2] if known else 0.0
            for key in [k for k, f in factors.items() if k[1] == label and not math.isfinite(f)]:
                factors[key] = fill
        return factors, "layer"
    if not measured:
        raise QuantkitError("the sensitivity table needs measured KL to calibrate its proxy: measure the layers "
                            "or a sample of at least one linear")
    per_scheme = {}
    for label in labels:
        pairs = [(proxy[k], v) for k, v in measured.items() if k[1] == label]
        den = sum(p * p for p, _ in pairs)
        per_scheme[label] = max(sum(p * v for p, v in pairs) / den, 0.0) if den > 0 else 0.0
    return {(i, l): per_scheme[l] for i in by_layer for l in labels}, "scheme"


def proxy_check(measured: dict, predicted: dict, proxy: dict, in_sample: bool) -> dict[str, Any]:
    """How well the proxy tracks measured KL on the sampled linears: correlation (Pearson, on logs: the
    values span decades) of the raw proxy and the measured KL, and the calibrated prediction's error."""
    keys = [k for k in measured if measured[k] > 0 and proxy[k] > 0]
    out: dict[str, Any] = {"modules_x_schemes": len(measured), "in_sample": in_sample}
    if len(keys) >= 3:
        lx = torch.tensor([math.log(proxy[k]) for k in keys], dtype=torch.float64)
        ly = torch.tensor([math.log(measured[k]) for k in keys], dtype=torch.float64)
        out["pearson_log_proxy_vs_measured"] = round(float(torch.corrcoef(torch.stack([lx, ly]))[0, 1]), 4)
    rel = [abs(predicted[k] - measured[k]) / measured[k] for k in keys]
    if rel:
        rel.sort()
        out["median_abs_relative_error"] = round(rel[len(rel) // 2], 4)
        out["sum_predicted_over_sum_measured"] = round(sum(predicted[k] for k in keys) / sum(measured[k] for k in keys), 4)
    return out
