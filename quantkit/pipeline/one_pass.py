"""The one-pass strategy: true-sequential quantization of a layer inside a single forward over the one
calibration batch. Each target linear's pre-hook observes its input, quantizes it and fake-quantizes
it in place, so everything after it in the forward (later stages, the layer's output) already sees
it quantized: the staged strategy's result (tested bit for bit) when each stage's linears share one
input and stages follow the forward order, which the hooks check. No extra pass gives the next
layer's inputs: the forward's output is them.

A recipe that compares with the unquantized model (GPTAQ: `needs_reference_inputs`) gets each
stage's input in the unquantized layer from one forward of that layer first (`ReferenceCapture`,
the same chunked forward with nothing quantized), handed to the observers in the very rows the
quantizing forward observes; that forward's output is the unquantized stream's next input, so the
driver runs no further pass for it.

Memory-shaped pieces (`chunked`) run the MLP, attention and norms in chunks. Two further savings
rest on the decoder layer being a sequential pre-norm residual block (attention, then MLP, each
added to the residual): the norms' outputs sharing one scratch buffer, the attention output and
the MLP products another, and the layer's input being freed when the MLP starts. The adapter says
whether a family is built that way; `structure_allows_sharing` checks it on a probe forward of the
real layer before relying on it, once per layer class.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from quantkit.errors import QuantkitError
from quantkit.layer_io import layer_output, slice_batch, to_device
from quantkit.pipeline.chunked import (SequenceChunkedAttention, norm_names, run_mlp_in_token_chunks,
                                       run_norms_in_row_chunks)
from quantkit.pipeline.memory_policy import MemoryPolicy, ScratchBuffers
from quantkit.pipeline.residency import to_cpu
from quantkit.pipeline.staged import quantize_in_place, target_stages
from quantkit.qtensor import QuantizedWeight
from quantkit.quantizers.base import LayerContext
from quantkit.quantizers.recipe import Recipe

PROBE_SEQUENCES = 16  # enough rows that the probe forward crosses every chunk boundary of the demo's layers


class OnePassLayer:
    """The one-pass bookkeeping for one layer: the stage now open, its input, the results.

    At a stage's first linear the recipe observes every linear of the stage with that input (as the
    staged strategy does before quantizing any; GPTQ then solves linears sharing a Hessian
    together); the stage's other linears must then run on that very tensor. Only the open stage's
    input is held, and only until the stage is quantized, so no stage input outlives its use."""

    def __init__(self, ctx: Optional[LayerContext], recipe: Optional[Recipe], policy: MemoryPolicy,
                 scratch: Optional[ScratchBuffers] = None, share: bool = False,
                 references: Optional["StageReferences"] = None, layer: Optional[torch.nn.Module] = None):
        self.ctx, self.recipe, self.policy, self.references = ctx, recipe, policy, references
        self.layer = ctx.layer if layer is None else layer  # the layer whose forward this bookkeeping hooks
        self.stages = target_stages(ctx, recipe) if recipe is not None else []
        self.stage_of = {n: k for k, stage in enumerate(self.stages) for n in stage}
        self.modules = {n: self.layer.get_submodule(n) for n in self.stage_of}
        self.results: dict[str, QuantizedWeight] = {}
        self.open_stage: Optional[int] = None
        self.open_input: Optional[torch.Tensor] = None
        self.scratch = scratch if share else None
        self.input_reusable = share  # the MLP's output may be written over its input
        self.layer_input: Optional[torch.Tensor] = None  # freed when the MLP starts, where sharing is allowed
        self._suspended = False

    @contextlib.contextmanager
    def suspended(self):
        """The hooks let linears run untouched (the chunked attention's per-chunk projections)."""
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False

    def free_layer_input(self, keep: torch.Tensor) -> None:
        """Free the decoder layer's input once the MLP starts (transformers' forward wrappers keep it
        referenced to the end of the layer): 75 MB less through the MLP on the demo. Its storage is
        emptied in place, so anything that still read it would fail loudly, never read stale data;
        the probe forward has shown nothing does."""
        x, self.layer_input = self.layer_input, None
        if x is not None and x.untyped_storage().data_ptr() != keep.untyped_storage().data_ptr():
            x.untyped_storage().resize_(0)

    def row_chunks(self, n_rows: int, rows: int) -> list[tuple[int, int]]:
        """The layer input's rows in chunks of at most `rows`: restarting at every leaf of the
        calibration set when the recipe sums over them (quantkit.reduction), so each chunk's rows
        are the same whatever share of the set this process holds."""
        samples = self.ctx.samples if self.recipe is not None else None
        if samples is None:
            return [(s, min(s + rows, n_rows)) for s in range(0, n_rows, rows)]
        chunks = samples.row_chunks(rows)
        if not chunks or chunks[-1][1] != n_rows:
            self.fail(f"its input has {n_rows} rows where the calibration set gives {chunks[-1][1] if chunks else 0}")
        return chunks

    def require_all_ran(self, forward: str) -> None:
        missing = [n for n in self.stage_of if n not in self.results]
        if missing:
            self.fail(f"{missing[0]} never ran in {forward}")

    def fail(self, problem: str):
        raise QuantkitError(f"layer {self.ctx.index}: {problem}, so its linears cannot be quantized inside one forward; "
                            "pass a --batch-size below --num-samples to calibrate stage by stage")

    def enter(self, name: str, x: torch.Tensor) -> None:
        """`name` is about to run on `x`: check the order; the stage's first linear opens it."""
        k = self.stage_of[name]
        if name in self.results:
            self.fail(f"{name} runs twice in one forward")
        if any(n not in self.results for stage in self.stages[:k] for n in stage):
            self.fail(f"{name} runs before an earlier stage is complete")
        if self.open_stage != k:
            linears = self.stages[k]
            if any(getattr(self.modules[n], "in_features", x.shape[-1]) != x.shape[-1] for n in linears):
                self.fail(f"the linears of stage {linears} do not share one input")
            self.open_stage, self.open_input = k, x
            self.observe_more(name, x)
        elif self.open_input is not x:
            self.fail(f"the linears of stage {self.stages[k]} do not share one input")

    def observe_more(self, name: str, x: torch.Tensor) -> None:
        """More rows of the open stage's input (a chunked MLP hands down's input over in chunks),
        with the same rows' input in the unquantized layer where the recipe compares with it."""
        k = self.stage_of[name]
        reference = self.references.next_rows(k, x, self) if self.references is not None else None
        for n in self.stages[k]:
            self.recipe.observe(n, self.modules[n], x, reference=reference)

    def quantize(self, name: str) -> None:
        self.results[name] = quantize_in_place(self.ctx, self.recipe, name, self.modules[name])
        self.close_if_complete()

    def close_if_complete(self) -> None:
        k = self.open_stage
        if all(n in self.results for n in self.stages[k]):
            self.open_input = None
            if self.references is not None:
                self.references.release(k, self)

    def pre_hook(self, name: str):
        def hook(module, args):
            if not self._suspended:
                self.enter(name, args[0])
                self.quantize(name)

        return hook


class StageReferences:
    """Each stage's input in the unquantized layer (`ReferenceCapture`'s rows, in the chunks it saw
    them), handed out in the rows the quantizing forward observes and let go as they are."""

    def __init__(self, chunks: dict[int, list]):
        self.chunks = chunks

    def next_rows(self, stage: int, x: torch.Tensor, state: OnePassLayer) -> torch.Tensor:
        """The reference rows matching `x`'s rows, the next ones of `stage` (views where the two
        forwards chunked alike, as the one-pass forward does)."""
        wanted, pieces, chunks = x.numel() // x.shape[-1], [], self.chunks.get(stage, [])
        while wanted:
            if not chunks:
                state.fail(f"stage {state.stages[stage]} observed more rows in the quantized layer than in the "
                           "unquantized one")
            head = chunks[0]
            if head.shape[-1] != x.shape[-1]:
                state.fail(f"stage {state.stages[stage]} has inputs of width {x.shape[-1]} in the quantized layer "
                           f"and {head.shape[-1]} in the unquantized one")
            pieces.append(head[:wanted])
            if head.shape[0] <= wanted:
                chunks.pop(0)
            else:
                chunks[0] = head[wanted:]
            wanted -= pieces[-1].shape[0]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def release(self, stage: int, state: OnePassLayer) -> None:
        """The stage is quantized: every reference row must have been used (else rows were paired wrongly)."""
        if self.chunks.pop(stage, None):
            state.fail(f"stage {state.stages[stage]} observed fewer rows in the quantized layer than in the "
                       "unquantized one")


class ReferenceCapture(OnePassLayer):
    """The unquantized layer (`ctx.reference_layer`) run through the one-pass forward with nothing
    quantized: each stage's input recorded instead, copied (the forward writes over its buffers).
    The stream's input is neither freed nor written over: the driver still holds it."""

    def __init__(self, ctx: LayerContext, recipe: Recipe, policy: MemoryPolicy, scratch: Optional[ScratchBuffers]):
        super().__init__(ctx, recipe, policy, scratch, share=scratch is not None, layer=ctx.reference_layer)
        self.input_reusable = False
        self.chunks: dict[int, list] = {}

    def observe_more(self, name: str, x: torch.Tensor) -> None:
        self.chunks.setdefault(self.stage_of[name], []).append(x.detach().reshape(-1, x.shape[-1]).clone())

    def quantize(self, name: str) -> None:
        self.results[name] = None  # seen: the order checks of `enter` hold for this forward too
        self.close_if_complete()

    def stage_inputs(self) -> StageReferences:
        self.require_all_ran("the unquantized layer's forward")
        return StageReferences(self.chunks)


@torch.no_grad()
def chunked_forward(ctx: LayerContext, state: OnePassLayer, args: list, kwargs: dict) -> torch.Tensor:
    """The forward of `state`'s layer over `args` ([hidden], handed over: the list is emptied, so only the
    forward holds the input) with the chunked MLP, attention and norms, hooks installed."""
    adapter, layer = ctx.adapter, state.layer
    handles = [m.register_forward_pre_hook(state.pre_hook(n)) for n, m in state.modules.items()]
    mlp, attention = adapter.gated_mlp(layer), adapter.attention(layer)
    undo = [run_mlp_in_token_chunks(layer, mlp, state) if mlp else None,
            SequenceChunkedAttention(layer, attention, state).install() if attention else None,
            run_norms_in_row_chunks(layer, norm_names(adapter, layer), state.scratch)]
    if state.input_reusable:
        state.layer_input = args[0]
    try:
        # `.forward`, unlike `__call__`, keeps no reference to its arguments
        return layer_output(layer.forward(args.pop(), **kwargs))
    finally:
        for h in handles:
            h.remove()
        for restore in undo:
            if restore is not None:
                restore()


@torch.no_grad()
def structure_allows_sharing(ctx: LayerContext, policy: MemoryPolicy, device, compute_dtype) -> bool:
    """Whether this layer's forward gives the same output when the norms share one buffer, the
    attention output and MLP products another, and the layer input is freed when the MLP starts.

    The adapter claims it (a sequential pre-norm residual block); this checks it where the one-pass
    strategy relies on it: the chunked forward on a few calibration sequences, with and without the
    sharing, must agree bit for bit (and must not read the freed input, which would raise)."""
    mlp = ctx.adapter.gated_mlp(ctx.layer)
    if mlp is None or not mlp.sequential_residual:
        return False
    (hidden, kwargs), = ctx.inputs
    rows = min(hidden.shape[0], PROBE_SEQUENCES)
    sample = to_device(hidden[:rows], device).to(compute_dtype)
    part = to_device(slice_batch(kwargs, rows, hidden.shape[0], hidden.shape[1] if hidden.dim() > 2 else 1), device)
    plain = chunked_forward(ctx, OnePassLayer(ctx, None, policy), [sample.clone()], part)
    try:
        shared = chunked_forward(ctx, OnePassLayer(ctx, None, policy, ScratchBuffers(), share=True), [sample.clone()],
                                 part)
    except RuntimeError:  # the freed input was read after all
        return False
    return torch.equal(plain, shared)


class OnePassStrategy:
    """One forward per layer over the single calibration batch (see the module docstring)."""

    name = "one-pass"

    def __init__(self, policy: MemoryPolicy):
        self.policy = policy
        self.scratch = policy.scratch()  # big intermediates, reused by every layer
        self._sharing: dict[type, bool] = {}  # layer class -> probe verdict

    def quantize_layer(self, ctx: LayerContext, recipe: Recipe, device, compute_dtype,
                       observe: bool) -> tuple[dict[str, QuantizedWeight], list]:
        kind = type(ctx.layer)
        if kind not in self._sharing:
            self._sharing[kind] = self.scratch is not None and structure_allows_sharing(ctx, self.policy, device,
                                                                                        compute_dtype)
        share = self._sharing[kind]
        references = (self.capture_references(ctx, recipe, device, compute_dtype, share)
                      if recipe.needs_reference_inputs else None)
        state = OnePassLayer(ctx, recipe, self.policy, self.scratch, share=share, references=references)
        (hidden, kwargs), = ctx.inputs
        home = hidden.device
        # the layer's input leaves the list (its output will replace it), so only the forward holds it
        ctx.inputs[0] = (None, kwargs)
        args = [to_device(hidden, device).to(compute_dtype)]
        del hidden
        out = chunked_forward(ctx, state, args, to_device(kwargs, device))
        state.require_all_ran("the forward")
        return ({ctx.prefix + n: to_cpu(state.results[n]) for stage in state.stages for n in stage}, [out.to(home)])

    def capture_references(self, ctx: LayerContext, recipe: Recipe, device, compute_dtype,
                           share: bool) -> StageReferences:
        """One forward of the unquantized layer over the unquantized stream: its stages' inputs, and
        its output as the stream's next input (`ctx.reference_outputs`, which the driver then keeps)."""
        (hidden, kwargs), = ctx.reference_inputs
        capture = ReferenceCapture(ctx, recipe, self.policy, self.scratch if share else None)
        out = chunked_forward(ctx, capture, [to_device(hidden, device).to(compute_dtype)], to_device(kwargs, device))
        references = capture.stage_inputs()
        ctx.reference_outputs = [out.to(hidden.device)]
        return references
