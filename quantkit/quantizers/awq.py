"""AWQ (activation-aware weight quantization) as a recipe transform.

The method `awq` is this transform finished by round-to-nearest (the grid its searches simulate);
`awq,gptq` (the bundled recipe `awq-gptq`) hands the scaled, clipped layer to GPTQ instead.
Per decoder layer, in `begin_layer` (AutoAWQ's `_search_best_scale` / `_search_best_clip`):

1. One calibration pass with hooks records, for every input group of the architecture adapter
   (norm -> q/k/v, v -> o, norm -> gate/up, up -> down, ...), the mean |x| per input channel over
   all calibration tokens, the inputs of the group's ``inspect`` module and a strided token
   subsample of every clipped linear's input. Attention mixes tokens, so its inputs are whole
   sequences (up to ``max_search_tokens``); a token-wise ``inspect`` (an MLP, a linear) gets a
   strided sample of ``token_search_tokens`` tokens drawn from every sequence and position.
2. Scale search, per group, on the layer's original weights: for alpha in {0, 1/n, ..., (n-1)/n}
   s = x_mean^alpha (``duo_scaling``: / (w_mean^(1-alpha) + 1e-4), w_mean being the mean of the
   group-normalised |W| per input channel; for v -> o under GQA both means are averaged over the o
   columns one v row feeds, which AutoAWQ skips), clamped at 1e-4 and normalised by sqrt(max*min);
   the group's linears become fake_quant(W*s)/s and the loss is the MSE of the ``inspect``
   module's output (attention block for q/k/v, MLP for gate/up, the linear itself otherwise)
   against its full-precision output. The first alpha with the lowest loss wins. When ``inspect``
   is the group's one linear its output MSE is mean((X dW^T)^2) with dW = fake_quant(W*s)/s - W
   (the bias cancels); with more sampled tokens T than inputs K it is computed from the Gram
   matrix G = X^T X as sum((dW G) * dW) / (T N): the same number for a K x K x N product per
   alpha instead of T x K x N.
3. The chosen scales are folded into ``prev`` (``fold_scales``: exact in full precision), and
   the cached clip inputs of the group's linears are divided by s, as AutoAWQ's ``apply_scale``
   does, so they are what the scaled linears will actually see.
4. Clipping search (``clip``), per linear except q/k: per (output row, group) the range
   [min(wmin, 0), max(wmax, 0)] is shrunk by r in {1, 1 - 1/n, ..., > 1 - max_shrink}
   (AutoAWQ's grid: 1.0 ... 0.55 by default), the weights are clamped to it and fake-quantized,
   and the r with the lowest error of the group's partial output x_g . w_g on the sampled tokens
   wins (computed from their Gram matrix X^T X: one product, then no token count in the search).
   With ``clip_objective`` "output" each row's choice is then refined toward the error of its whole
   output, whose cross terms between groups the per-group measure leaves out. The weights are
   clamped in place.

The recipe's weight quantizer then quantizes the scaled, clipped weights. The chosen alphas, loss curves and clip ratios are kept
per layer in ``search_log``.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.models.folding import fold_scales
from quantkit.layer_io import batch_shapes, layer_output, slice_rows
from quantkit.quantizers.base import LayerContext, Transform, register_step
from quantkit.quantizers.grid import check_sym_range, fake_quantize_grouped
from quantkit.reduction import LocalComm, RowSum, SampleLayout
from quantkit.scheme import LinearScheme

# AutoAWQ's avoid_clipping list (["q_", "k_", "query", "key", "Wqkv"]) plus fused qkv_proj (Phi-3):
# clipping q/k hurts attention scores more than it saves in rounding error.
CLIP_SKIP = ("q_", "k_", "query", "key", "wqkv", "qkv_proj")
SCALE_EPS = 1e-4  # AutoAWQ: denominator guard and lower clamp of the scales
_CLIP_CHUNK_ELEMS = 1 << 25  # bound on the [ratios, rows, K] candidate errors the clip search holds at once
CLIP_OBJECTIVES = ("group", "output")


def skips_clip(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1].lower()
    return any(p in leaf for p in CLIP_SKIP)


def weight_mean(weights: list[torch.Tensor], group_sizes: list[int]) -> torch.Tensor:
    """AutoAWQ's w_mean: |W| normalised by each quantization group's absmax, averaged over all output rows."""
    rows = []
    for w, g in zip(weights, group_sizes):
        n, k = w.shape
        gs = k if g == -1 else g
        wg = w.detach().float().abs().reshape(-1, gs)
        rows.append((wg / (wg.amax(dim=1, keepdim=True) + 1e-6)).reshape(n, k))
    return torch.cat(rows, dim=0).mean(0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, alpha: float) -> torch.Tensor:
    """s for one grid point, exactly as AutoAWQ's _compute_best_scale builds it."""
    if w_mean is not None:
        s = x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + SCALE_EPS)
    else:
        s = x_mean.pow(alpha)
    s = s.clamp(min=SCALE_EPS)
    s = s / (s.max() * s.min()).sqrt()
    s[~torch.isfinite(s)] = 1.0
    return s


def clip_ratios_grid(n_grid: int, max_shrink: float) -> list[float]:
    """AutoAWQ's shrink grid: 1 - i/n_grid for i < max_shrink*n_grid (1.0, 0.95, ..., 0.55 by default)."""
    return [1.0 - i / n_grid for i in range(max(1, int(max_shrink * n_grid)))]


def _clip_bounds(w: torch.Tensor, gs: int, sym: bool = False):
    """Per (row, group) range of w [N, K] as [N, G, 1] tensors: [min(wmin,0), max(wmax,0)] for an
    asymmetric grid; for a symmetric one [-absmax, absmax], since only the absmax sets its scale
    (shrinking the other side too would distort weights for no finer grid)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // gs, gs)
    if sym:
        amax = wg.abs().amax(dim=2, keepdim=True)
        return -amax, amax
    return wg.amin(dim=2, keepdim=True).clamp(max=0.0), wg.amax(dim=2, keepdim=True).clamp(min=0.0)


def clip_weight(w: torch.Tensor, ratios: torch.Tensor, group_size: int, sym: bool = False) -> torch.Tensor:
    """``w`` [N, K] clamped per (row, group) to its range (`_clip_bounds`) shrunk by r = ratios [N, G]."""
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    lo, hi = _clip_bounds(w, gs, sym)
    r = ratios.to(device=w.device, dtype=torch.float32).reshape(n, k // gs, 1)
    wg = w.float().reshape(n, k // gs, gs)
    return torch.maximum(torch.minimum(wg, hi * r), lo * r).reshape(n, k).to(w.dtype)


def check_clip_objective(objective) -> None:
    if objective not in CLIP_OBJECTIVES:
        raise QuantkitError(f"awq option clip_objective must be one of {', '.join(CLIP_OBJECTIVES)}, got {objective!r}")


def clip_candidates(w: torch.Tensor, scheme: LinearScheme, grid: list[float], sym_range: str) -> torch.Tensor:
    """The rounding error d = q(clip(w, r)) - w of every ratio r of ``grid``, all groups at once: [R, N, K]."""
    n, k = w.shape
    gs = k if scheme.group_size == -1 else scheme.group_size
    full = torch.ones((n, k // gs), device=w.device)
    return torch.stack([fake_quantize_grouped(clip_weight(w, full * r, gs, scheme.sym), scheme, sym_range) - w
                        for r in grid])


def group_errors(deltas: torch.Tensor, gram: torch.Tensor, gs: int) -> torch.Tensor:
    """Per candidate, row and group the error of the group's partial output, mean_t (x_g . d_g)^2 =
    d_g^T H_gg d_g (H = X^T X / T): AutoAWQ's _compute_best_clip measure. deltas [R, N, K] -> [R, N, G]."""
    r, n, k = deltas.shape
    g = k // gs
    blocks = torch.stack([gram[j * gs:(j + 1) * gs, j * gs:(j + 1) * gs] for j in range(g)])  # [G, gs, gs]
    d = deltas.reshape(r * n, g, gs).transpose(0, 1)  # [G, R*N, gs]
    return (torch.bmm(d, blocks) * d).sum(-1).transpose(0, 1).reshape(r, n, g)


def refine_on_output(deltas: torch.Tensor, own: torch.Tensor, gram: torch.Tensor, index: torch.Tensor, gs: int,
                     sweeps: int) -> torch.Tensor:
    """Coordinate descent of each row's whole output error over its groups' candidates.

    A row's output error is mean_t (x_t . d)^2 = d^T H d, which has cross terms d_g^T H_gh d_h between
    groups that the per-group measure leaves out (errors of opposite sign cancel, of one sign add up).
    With the other groups fixed, candidate r of group g costs 2 d_g(r) . c + d_g(r)^T H_gg d_g(r),
    c = (H d)_g less group g's own part; the second term is `group_errors`' ``own`` [R, N, G], fixed.
    Every row at once, group after group; a group keeps its candidate unless another is strictly
    better, so no row's error rises. index [N, G] is updated."""
    r, n, k = deltas.shape
    g = k // gs
    rows = torch.arange(n, device=deltas.device)
    d = deltas.reshape(r, n, g, gs)[index, rows[:, None], torch.arange(g, device=deltas.device)].reshape(n, k)
    for _ in range(sweeps):
        for j in range(g):
            cols = slice(j * gs, (j + 1) * gs)
            c = d @ gram[:, cols] - d[:, cols] @ gram[cols, cols]  # [N, gs]: the other groups' coupling to group j
            cand = deltas[:, :, cols]  # [R, N, gs]
            cost = 2 * (cand * c).sum(-1) + own[:, :, j]  # [R, N]
            best_cost, best = cost.min(0)
            take = best_cost < cost[index[:, j], rows]
            index[:, j] = torch.where(take, best, index[:, j])
            d[:, cols] = cand[index[:, j], rows]
    return index


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, scheme: LinearScheme, n_grid: int = 20, max_shrink: float = 0.5,
                sym_range: str = "exact", objective: str = "group", sweeps: int = 2) -> torch.Tensor:
    """Best clip ratio per (output row, group) of ``w`` [N, K] for inputs ``x`` [T, K].

    objective "group" (AutoAWQ's _compute_best_clip): each (row, group) alone, by the mean over tokens
    of (x_g . (q(clip(w_g)) - w_g))^2, the squared error of the group's partial output; ties keep the
    larger ratio. "output": that choice refined by `refine_on_output` toward the row's whole output
    error. Both run from H = X^T X / T (T x K x K once, then no token count in the search).
    Returns ratios [N, G].
    """
    check_clip_objective(objective)
    n, k = w.shape
    gs = k if scheme.group_size == -1 else scheme.group_size
    grid = clip_ratios_grid(n_grid, max_shrink)
    x = x.reshape(-1, k).to(device=w.device, dtype=torch.float32)
    gram = (x.t() @ x) / max(1, x.shape[0])
    w = w.float()
    index = []
    chunk = max(1, min(n, _CLIP_CHUNK_ELEMS // max(1, len(grid) * k)))  # rows are independent
    for start in range(0, n, chunk):
        deltas = clip_candidates(w[start:start + chunk], scheme, grid, sym_range)
        err = group_errors(deltas, gram, gs)
        best = err.argmin(0)  # the first minimum: the larger ratio wins ties
        if objective == "output":
            best = refine_on_output(deltas, err, gram, best, gs, sweeps)
        index.append(best)
    return torch.tensor(grid, device=w.device)[torch.cat(index)]


# ----------------------------------------------------------------------------- capture

def _strided_rows(x: torch.Tensor, offset: int, stride: int) -> torch.Tensor:
    """The rows of one batch's tokens x (starting at global token ``offset``) that fall on a single
    stride running over all batches, so the sample is the same however the set is batched."""
    return x[(-offset) % stride::stride]


def _token_wise(group) -> bool:
    """Whether the group's loss may run on a token sample: its inspect module maps tokens one by one."""
    return group.token_wise or group.inspect in group.linears


class _Capture:
    """What one hooked calibration pass of a layer collects for the searches, over the whole
    calibration set: per group the mean |x| per input channel (sums through
    `quantkit.reduction.RowSum`), the inputs of non-token-wise inspect modules (whole sequences, cut
    at the reduction leaves), strided token samples for token-wise inspect modules and for the
    clipped linears (by global token position, gathered from every data-parallel rank). Routed
    experts see the tokens routed to them: some batches or none, a varying number of rows."""

    def __init__(self, layout: SampleLayout, options: dict, groups, clip_targets: list[str], routed: frozenset):
        self.layout, self.routed = layout, routed
        total = layout.n_samples * layout.rows_per_sample
        self.budget = {"token": options["token_search_tokens"], "clip": options["clip_search_tokens"]}
        self.stride = {role: 1 if not n else max(1, total // int(n)) for role, n in self.budget.items()}
        self.search_n = layout.leading_sequences(options["max_search_tokens"])
        self.mean_of = {g.input_module for g in groups}
        self.token_wise = {g.inspect for g in groups if _token_wise(g)}
        self.inspect_of = {g.inspect for g in groups} - self.token_wise
        self.clip_set = set(clip_targets)
        self.names = sorted(self.mean_of | self.inspect_of | self.token_wise | self.clip_set)
        self.x_abs_sum: dict[str, RowSum] = {}  # group input module -> sum |x| per channel
        self.x_count: dict[str, int] = {}
        self.inspect_inputs: dict[str, list] = {}  # inspect module -> [(args, kwargs)] of the sampled sequences
        self.token_x: dict[str, list] = {}  # token-wise inspect module -> [tokens, K] pieces (then one tensor)
        self.clip_x: dict[str, list] = {}  # clipped linear -> [tokens, K] pieces
        self.calls: dict[str, int] = {}
        self.batch = -1  # the calibration batch the layer is running (a pre-hook on the layer counts them)

    def next_batch(self, module, args) -> None:
        self.batch += 1

    def sample(self, name: str, x2: torch.Tensor, role: str) -> torch.Tensor:
        """A strided sample of this batch's rows, on one stride over the whole set (so it does not
        depend on the batching or the rank count); a routed expert's rows, which vary per batch, on a
        stride aiming at the budget."""
        n = self.budget[role]
        if name in self.routed:
            return x2[::max(1, -(-x2.shape[0] * len(self.layout.batches) // n))] if n else x2
        offset = self.layout.batches[self.batch][0] * self.layout.rows_per_sample  # global token position
        return _strided_rows(x2, offset, self.stride[role])

    def hook(self, name: str, shapes: list):
        def record(module, args, kwargs):
            i = self.batch
            if self.calls.get(name, 0) > i:
                raise QuantkitError(f"awq: '{name}' ran more than once per calibration batch; unsupported layout")
            self.calls[name] = self.calls.get(name, 0) + 1
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
            x2 = x.detach().reshape(-1, x.shape[-1])
            if name in self.mean_of:
                self._add_abs(name, x2)
            if name in self.inspect_of:
                b, t = shapes[i]
                self.inspect_inputs.setdefault(name, []).extend(
                    (slice_rows(args, a, e, b, t), slice_rows(kwargs, a, e, b, t))
                    for a, e in self.layout.leading_pieces(i, self.search_n))
            if name in self.token_wise:
                self.token_x.setdefault(name, []).append(self.sample(name, x2, "token").clone())
            if name in self.clip_set:
                self.clip_x.setdefault(name, []).append(self.sample(name, x2, "clip").float().clone())

        return record

    def _add_abs(self, name: str, x2: torch.Tensor) -> None:
        # a routed expert's rows are not the dense rows the layout counts: a plain running sum (MoE
        # runs in one process, see api._expert_policy)
        total = self.x_abs_sum.setdefault(name, RowSum(None if name in self.routed else self.layout))
        total.add(x2.shape[0], lambda rows, part: _abs_sum(x2[rows], part))
        self.x_count[name] = self.x_count.get(name, 0) + x2.shape[0]

    def finish(self, n_batches: int) -> None:
        """Check every hook ran once per batch (a routed expert at most once); counts and samples
        over every rank."""
        for name in self.names:
            calls = self.calls.get(name, 0)
            if calls != n_batches and not (name in self.routed and calls < n_batches):
                raise QuantkitError(f"awq: '{name}' ran {calls} times for {n_batches} calibration batches; "
                                    "unsupported layout")
        comm = self.layout.comm
        names = sorted(self.x_count)
        self.x_count = dict(zip(names, comm.sum_ints([self.x_count[n] for n in names])))
        self.clip_x = {n: comm.gather_rows(torch.cat(v)) for n, v in sorted(self.clip_x.items())}
        self.token_x = {n: comm.gather_rows(torch.cat(v)) for n, v in sorted(self.token_x.items())}

    def x_mean(self, name: str) -> torch.Tensor:
        return (self.x_abs_sum[name].total() / max(1, self.x_count[name])).float()


def _abs_sum(x: torch.Tensor, partial: torch.Tensor | None) -> torch.Tensor:
    s = x.float().abs().sum(0)
    return s if partial is None else partial.add_(s)


@register_step
class AWQTransform(Transform):
    name = "awq"
    default_sym = False
    default_format = "awq"
    option_words = {"duo_scaling": ("both",)}
    options_spec = {
        # s = x_mean^a / w_mean^(1-a) (AutoAWQ's default) instead of x_mean^a; "both": every alpha with
        # each, 2 x n_grid trials (llm-compressor's duo_scaling="both")
        "duo_scaling": True,
        "n_grid": 20,  # alpha grid {0, 1/n, ..., (n-1)/n}
        "full_grid": False,  # also try no scaling (s = 1) and alpha = 1, as llm-compressor does
        # the scale-search loss re-runs its block 20 times, so it runs on samples (0: all tokens):
        "max_search_tokens": 2048,  # whole sequences, for blocks that mix tokens (attention)
        "token_search_tokens": 4096,  # a strided token sample from every sequence, for token-wise blocks (MLP, a linear)
        "clip": True,  # search and apply per-group weight clipping
        "clip_n_grid": 20,
        "clip_max_shrink": 0.5,  # ratios 1.0 down to (not including) 1 - max_shrink
        "clip_search_tokens": 4096,  # strided token sample for the clip error (AutoAWQ's 512: docs/defaults.yaml)
        # "output": AutoAWQ's per-(row, group) choice, then coordinate descent on each row's whole output
        # error, cross terms between groups included (search_clip; docs/defaults.yaml); "group": AutoAWQ's
        "clip_objective": "output",
        # the symmetric grid the searches simulate and the finishing RTN rounds on (grid.SYM_RANGES):
        # AutoAWQ's absmax/7, which keeps the salient weights the scales enlarge exact
        "sym_range": "exact",
        # the hidden states each layer is searched on: "float", the unquantized model's (AutoAWQ's flow:
        # each layer's scales fit the activations the original model produces), or "quantized", the
        # outputs of the layers quantized before it; in awq,gptq the quantizer's stream wins
        "inputs": "float",
        # also search v -> o under grouped-query attention, one scale per v row shared by the o columns it
        # feeds (AutoAWQ and llm-compressor skip the group: o is then only clipped); measured worse on
        # the demo (docs/defaults.yaml), so opt-in
        "gqa_v_o": False,
    }

    def __init__(self, **options):
        super().__init__(**options)
        o = self.options
        for key in ("n_grid", "clip_n_grid"):
            if not isinstance(o[key], int) or isinstance(o[key], bool) or o[key] < 1:
                raise QuantkitError(f"awq option {key} must be a positive integer, got {o[key]!r}")
        for key in ("max_search_tokens", "token_search_tokens", "clip_search_tokens"):
            if o[key] is not None and (not isinstance(o[key], int) or isinstance(o[key], bool) or o[key] < 0):
                raise QuantkitError(f"awq option {key} must be a non-negative integer (0: all tokens), got {o[key]!r}")
        check_sym_range(o["sym_range"], "awq option ")
        if o["duo_scaling"] not in (True, False, "both"):
            raise QuantkitError(f"awq option duo_scaling must be true, false or both, got {o['duo_scaling']!r}")
        if not 0 < float(o["clip_max_shrink"]) < 1:
            raise QuantkitError(f"awq option clip_max_shrink must be in (0, 1), got {o['clip_max_shrink']!r}")
        check_clip_objective(o["clip_objective"])
        if not isinstance(o["gqa_v_o"], bool):
            raise QuantkitError(f"awq option gqa_v_o must be true or false, got {o['gqa_v_o']!r}")
        if o["inputs"] not in ("float", "quantized"):
            raise QuantkitError(f"awq option inputs must be float or quantized, got {o['inputs']!r}")
        self.calibration_stream = o["inputs"]  # an instance attribute: the recipe reads it
        self.search_log: dict[int, dict[str, Any]] = {}

    def finishing_rtn_options(self) -> dict[str, Any]:
        return {**super().finishing_rtn_options(), "sym_range": self.options["sym_range"]}

    # -- driver hooks --------------------------------------------------------------------
    def begin_layer(self, ctx: LayerContext) -> None:
        t0 = time.perf_counter()
        layer = ctx.layer
        groups = [g for g in ctx.adapter.input_groups(layer, ctx.config) if any(n in ctx.schemes for n in g.linears)
                  and (g.kv_heads is None or self.options["gqa_v_o"])]
        targets = [n for n in ctx.adapter.linear_names(layer) if n in ctx.schemes]
        clip_targets = [n for n in targets if not skips_clip(n)] if self.options["clip"] else []
        log: dict[str, Any] = {"groups": [], "clip": {}}
        self.search_log[ctx.index] = log
        if not ctx.inputs or not targets:
            return

        cap = self._capture(ctx, groups, clip_targets)
        # a routed expert no calibration token reached has nothing to balance: its scales stay 1
        searched = [(g, self._search_group(layer, g, cap, ctx.schemes) if g.input_module in cap.x_abs_sum
                     else {"alpha": None, "losses": [], "scales": torch.ones(layer.get_submodule(g.linears[0]).in_features)})
                    for g in groups]
        for group, found in searched:
            if found["alpha"] is not None:
                fold_scales(layer, group, found["scales"])
            for name in group.linears:
                if name in cap.clip_x:
                    s = found["scales"].to(cap.clip_x[name].device)
                    cap.clip_x[name] = cap.clip_x[name] / s
            log["groups"].append({"prev": group.prev, "linears": group.linears, "inspect": group.inspect,
                                  "alpha": found["alpha"], "duo": found.get("duo"), "losses": found["losses"],
                                  "scales": found["scales"].detach().cpu()})
        cap.inspect_inputs.clear()
        cap.token_x.clear()
        for name in clip_targets:
            x = cap.clip_x.pop(name, None)
            if x is None or not x.shape[0]:  # a routed expert no calibration token reached: left unclipped
                continue
            lin = layer.get_submodule(name)
            scheme = ctx.schemes[name]
            ratios = search_clip(lin.weight.data, x, scheme, int(self.options["clip_n_grid"]),
                                 float(self.options["clip_max_shrink"]), sym_range=self.options["sym_range"],
                                 objective=self.options["clip_objective"])
            with torch.no_grad():
                lin.weight.data = clip_weight(lin.weight.data, ratios, scheme.group_size, scheme.sym)
            log["clip"][name] = ratios.cpu()
        log["seconds"] = time.perf_counter() - t0

    def _fake_weight(self, name: str, w: torch.Tensor, scheme: LinearScheme) -> torch.Tensor:
        """The scaled weight `w` (float32) as the finishing rounding will round it: the scheme's integer groups
        (a subclass for another grid overrides this)."""
        return fake_quantize_grouped(w, scheme, self.options["sym_range"])

    # -- internals -------------------------------------------------------------------------
    @torch.no_grad()
    def _capture(self, ctx: LayerContext, groups, clip_targets) -> _Capture:
        shapes = batch_shapes(ctx.inputs)
        layout = ctx.samples or SampleLayout.of_batches(shapes)
        if len(layout.batches) != len(shapes):
            raise QuantkitError(f"awq: {len(shapes)} calibration batches where the layout has {len(layout.batches)}")
        cap = _Capture(layout, self.options, groups, clip_targets, ctx.adapter.routed_linears(ctx.layer))
        handles = [ctx.layer.register_forward_pre_hook(cap.next_batch)]
        handles += [ctx.layer.get_submodule(n).register_forward_pre_hook(cap.hook(n, shapes), with_kwargs=True)
                    for n in cap.names]
        try:
            ctx.run_layer()
        finally:
            for h in handles:
                h.remove()
        cap.finish(len(shapes))
        return cap

    def _run_inspect(self, module: nn.Module, batches: list) -> list[torch.Tensor]:
        return [layer_output(module(*args, **kwargs)) for args, kwargs in batches]

    def _loss(self, group, inspect: nn.Module, originals: dict, cap: _Capture) -> Callable[[], float]:
        """The search loss of the group as its linears now stand: the inspect block's output MSE
        against full precision, over the whole calibration set's sample (every rank's part of it)."""
        if group.linears == (group.inspect,):
            x = cap.token_x[group.inspect].float()  # the gathered sample: the same on every rank
            w0 = originals[group.inspect].float()
            t, k = x.shape
            # the linear's output MSE, mean((x dW^T)^2) with dW = W_q - W: the bias cancels, so it is
            # a quadratic form in dW, run from the Gram matrix when that is the smaller product
            gram = (x.t() @ x) / (t * w0.shape[0]) if t > k else None

            def linear_loss() -> float:
                dw = inspect.weight.float() - w0
                if gram is None:
                    return float((x @ dw.t()).pow(2).sum()) / (t * w0.shape[0])
                return float(((dw @ gram) * dw).sum())

            return linear_loss
        if _token_wise(group):  # the gathered token sample as one sequence [1, T, H] (a MoE block reads 3-D input)
            batches, comm = [((cap.token_x[group.inspect].unsqueeze(0),), {})], LocalComm()
        else:  # this rank's whole sequences, cut at the reduction leaves: terms summed over the ranks in order
            batches, comm = cap.inspect_inputs.get(group.inspect, []), cap.layout.comm
        reference = self._run_inspect(inspect, batches)
        numel, = comm.sum_ints([sum(r.numel() for r in reference)])

        def block_loss() -> float:
            out = self._run_inspect(inspect, batches)
            return comm.ordered_sum([float((o.float() - r.float()).pow(2).sum()) for o, r in zip(out, reference)]) / numel

        return block_loss

    @torch.no_grad()
    def _search_group(self, layer: nn.Module, group, cap: _Capture, schemes: dict[str, LinearScheme]) -> dict:
        # a GQA v -> o group's scales must be equal on the o columns one v row feeds: tying both
        # means makes every candidate so (candidate_scales is elementwise but for one global norm)
        x_mean = group.tie(cap.x_mean(group.input_module))
        quantized = [n for n in group.linears if n in schemes]
        linears = {n: layer.get_submodule(n) for n in quantized}
        duo = self.options["duo_scaling"]
        w_mean = None
        if duo:
            w_mean = weight_mean([m.weight for m in linears.values()], [schemes[n].group_size for n in quantized])
            w_mean = group.tie(w_mean)
        inspect = layer.get_submodule(group.inspect)
        originals = {n: m.weight.data.clone() for n, m in linears.items()}
        group_loss = self._loss(group, inspect, originals, cap)
        n_grid = int(self.options["n_grid"])
        alphas = [i / n_grid for i in range(n_grid + bool(self.options["full_grid"]))]
        # (alpha, scales, whether they use w_mean), in the order of `losses`
        candidates = [(a, candidate_scales(x_mean, w_mean, a), bool(duo)) for a in alphas]
        if duo == "both":  # then the same alphas without the weight term
            candidates += [(a, candidate_scales(x_mean, None, a), False) for a in alphas]
        if self.options["full_grid"]:
            candidates.insert(0, (None, torch.ones_like(x_mean), False))  # no scaling: the layer as it is
        losses: list[float] = []
        best = (math.inf, None, None, None)
        try:
            for alpha, s, with_w in candidates:
                for n, m in linears.items():
                    w = originals[n]
                    sv = s.to(device=w.device, dtype=torch.float32).view(1, -1)
                    m.weight.data = (self._fake_weight(n, w.float() * sv, schemes[n]) / sv).to(w.dtype)
                loss = group_loss()
                losses.append(loss)
                if loss < best[0]:
                    best = (loss, alpha, s.clone(), with_w)
        finally:
            for n, m in linears.items():
                m.weight.data = originals[n]
        if best[2] is None:
            raise QuantkitError(f"awq: the scale search for {group.linears} produced no finite loss; "
                                "the calibration data or weights contain NaN/inf")
        return {"alpha": best[1], "scales": best[2], "duo": best[3], "losses": losses}
