"""The layer-by-layer calibration driver. It knows nothing of any one method.

It captures what enters the first decoder layer (hidden states plus every keyword argument the
layer needs: masks, position ids, rotary embeddings), then per layer: moves it to the compute
device, runs the calibration batches with hooks that hand each target linear's inputs to the
quantizer, quantizes stage by stage (later stages see earlier ones already quantized), runs the
layer once more so the next layer sees the quantized layer's outputs, and moves it back.
When the calibration set is one batch and the quantizer allows it (`quantize_in_forward`), all of
that is a single forward pass: each linear is quantized from its own pre-hook, and a gated MLP
(the adapter's `gated_mlp`) runs in token chunks so its widest activations are never whole.
Only one decoder layer lives on the compute device; activations stay on `activation_device`.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from quantkit.errors import QuantkitError
from quantkit.memory import page_out_file_backed
from quantkit.models.base import NORM
from quantkit.qtensor import QuantizedWeight
from quantkit.progress import LayerRecord, ProgressStore
from quantkit.quantizers.base import LayerContext, Quantizer
from quantkit.scheme import LinearScheme
from quantkit.streaming import trim_heap


class _StopForward(Exception):
    pass


def _to(obj, device):
    """Move tensors inside nested tuples/lists/dicts to `device` (kwargs hold rotary tuples, masks...)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


@torch.no_grad()
def capture_layer_inputs(model, adapter, input_ids: torch.Tensor, batch_size: int, device, activation_device,
                         compute_dtype: Optional[torch.dtype] = None) -> list:
    """Run the model up to decoder layer 0 and record (hidden_states, kwargs) per batch.

    With `compute_dtype`, the modules before layer 0 run with their parameters in it (the model may
    be held in its bf16/fp16 storage dtype): the hidden states, masks and rotary tables then come out
    exactly as from a model loaded in `compute_dtype`. Buffers are left alone (rotary `inv_freq`
    stays fp32 in a bf16 model and must not be rounded on the way back)."""
    layers = adapter.decoder_layers(model)
    first = layers[0]
    captured = []

    class Catcher(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, hidden_states, *args, **kwargs):
            if args:
                raise QuantkitError("decoder layer received positional arguments the driver cannot replay")
            kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_value", "past_key_values")}
            kwargs["use_cache"] = False
            captured.append((hidden_states.to(activation_device), _to(kwargs, activation_device)))
            raise _StopForward

    pre_modules = [m for _, m in adapter.embeddings(model)]
    for m in pre_modules:
        m.to(device)
    # the originals are put back afterwards, not re-cast: a bf16 embedding viewing the safetensors
    # mapping would otherwise come back as a fresh 54 MB copy (the demo's) in anonymous memory
    stored = {p: p.data for m in pre_modules for p in m.parameters()} if compute_dtype is not None else {}
    for p in stored:
        p.data = p.data.to(compute_dtype)
    layers[0] = Catcher(first)
    try:
        for start in range(0, input_ids.shape[0], batch_size):
            batch = input_ids[start:start + batch_size].to(device)
            try:
                model(input_ids=batch, use_cache=False)
            except _StopForward:
                pass
    finally:
        layers[0] = first
        for p, original in stored.items():
            p.data = original
        for m in pre_modules:
            m.to(activation_device)
    return captured


# bytes of transient activations one calibration forward may take: a quantizer that can work inside
# one forward (GPTQ) saves whole passes when the set is one batch, so it may take more; the others
# gain nothing from one batch, and their memory should not grow with the calibration set
CALIBRATION_BATCH_BUDGET = 4 << 30
STAGED_BATCH_BUDGET = 1 << 30


def auto_batch_size(config, num_samples: int, seq_len: int, dtype: torch.dtype,
                    budget: int = CALIBRATION_BATCH_BUDGET) -> int:
    """Calibration sequences per forward: all of them when one decoder layer's forward over the whole
    set stays within `budget` (then GPTQ needs one pass per layer), else as many as fit. Read from
    the config alone, never from free memory, so a rerun batches (and rounds) the same."""
    config = getattr(config, "text_config", None) or config
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "d_model", 0) or 4096)
    intermediate = int(getattr(config, "intermediate_size", 0) or getattr(config, "ffn_dim", 0) or 4 * hidden)
    heads = int(getattr(config, "num_attention_heads", 0) or 32)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # gate, up and their product; a few hidden-sized tensors; attention scores and their softmax
    per_sequence = seq_len * itemsize * (3 * intermediate + 4 * hidden + 2 * heads * seq_len)
    return max(1, min(num_samples, budget // per_sequence))


def runs_in_one_pass(quantizer: Quantizer) -> bool:
    """Whether the quantizer uses the one-forward-per-layer driver when calibration is one batch
    (the driver's choice, and the reason such a quantizer gets the larger batch budget)."""
    return quantizer.needs_calibration and quantizer.needs_observe and quantizer.quantize_in_forward()


def _to_compute(layer: nn.Module, device, dtype: torch.dtype) -> dict:
    """Put the layer's tensors on `device`, floating ones in `dtype`, for its calibration; returns
    the stored tensors, which `_write_back` fills in place afterwards. Writing into the tensors the
    model already had, instead of `layer.to()` allocating new ones, keeps a model held in bf16 from
    scattering freshly allocated long-lived weights over the heap layer after layer (RSS crept up
    by ~300 MB over the demo's 30 layers)."""
    stored = {}
    for module in layer.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                if t is not None:
                    stored[(module, kind, name)] = t.data
                    t.data = t.data.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    return stored


def _write_back(layer: nn.Module, stored: dict) -> None:
    """The calibrated layer's values (fake-quantized weights, folded scales) back into its own storage."""
    with torch.no_grad():
        for (module, kind, name), original in stored.items():
            t = getattr(module, kind).get(name)
            if t is None or t.shape != original.shape:  # replaced by the quantizer: keep what it put there
                continue
            if t.data is not original:
                original.copy_(t.data)
                t.data = original


def _byte_ranges(tensors) -> list[tuple[int, int]]:
    """(address, nbytes) of each CPU tensor, for `page_out_file_backed`."""
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.device.type == "cpu"]


def _release_layer(stored: dict) -> None:
    """Drop a finished layer's tensors (to the meta device) and page its weights out of memory.

    A model loaded from safetensors views the file's mapping, so writing the fake-quantized values
    back (`_write_back`) copied each layer's pages into anonymous memory, and merely reading them
    kept them resident: either way RSS grew by one layer's weights per layer, to the whole model by
    the end. Once the layer's record is in the store nothing reads these tensors again."""
    from accelerate.utils import set_module_tensor_to_device

    sources = _byte_ranges(stored.values())
    for module, kind, name in stored:
        set_module_tensor_to_device(module, name, "meta")
    stored.clear()
    page_out_file_backed(sources)


def _layer_output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def quantize_model(
    model,
    adapter,
    quantizer: Quantizer,
    schemes: dict[str, LinearScheme],
    input_ids: Optional[torch.Tensor],
    device: torch.device | str = "cpu",
    activation_device: torch.device | str = "cpu",
    compute_dtype: torch.dtype = torch.float32,
    batch_size: int = 8,
    progress: bool = True,
    store: Optional[ProgressStore] = None,
    layer_source=None,
    release_layers: bool = False,
) -> dict[str, QuantizedWeight]:
    """Quantize every linear named in `schemes` (full names) and return their QuantizedWeights.

    The model's linears are left fake-quantized (weights replaced by their dequantized values),
    which is exactly what the next layer must see during calibration. With a `store`, each
    finished layer is saved and layers already there are restored instead of recomputed (resume);
    with a `layer_source` (streaming), a layer's weights are read from disk only while it is
    processed and dropped afterwards. With a `store` the returned dict stays empty: the results
    live only in the store (the checkpoint writer reads them there), so memory does not grow with
    the model's depth. With `release_layers` (needs a `store`; what `quantize` does, as it writes the
    checkpoint from the store) each finished layer's tensors are dropped instead (`_release_layer`),
    which leaves the model's layers on the meta device.
    """
    if release_layers and store is None:
        raise ValueError("release_layers needs a store: the results live only there")
    layers = adapter.decoder_layers(model)
    prefix = adapter.layers_prefix(model)
    needs_data = quantizer.needs_calibration
    if needs_data and input_ids is None:
        raise QuantkitError(f"method {quantizer.name!r} needs calibration data; pass --dataset")
    done = set(store.done_layers()) if store is not None else set()

    inputs = (capture_layer_inputs(model, adapter, input_ids, batch_size, device, activation_device, compute_dtype)
              if needs_data else [])
    if release_layers:  # from here on the weights are read one layer at a time (see _release_layer)
        page_out_file_backed(_byte_ranges(model.state_dict().values()))
    results: dict[str, QuantizedWeight] = {}
    finished: set[str] = set()
    scratch = ScratchBuffers()  # the one-pass forward's big intermediates, reused by every layer
    bar = tqdm(range(len(layers)), desc=f"{quantizer.name}", unit="layer", disable=not progress)
    for i in bar:
        t0 = time.perf_counter()
        if layer_source is not None:
            layer_source.materialize(i)
        layer = layers[i]
        stored = _to_compute(layer, device, compute_dtype)
        layer_prefix = f"{prefix}.{i}."

        def run_layer(layer=layer):
            outs = []
            for hidden, kwargs in inputs:
                out = layer(_to(hidden, device).to(compute_dtype), **_to(kwargs, device))
                outs.append(_layer_output(out).to(activation_device))
            return outs

        outputs = None
        if i in done:
            record = store.load_layer(i)
            _restore_layer(layer, layer_prefix, record)
            layer_results = record.quantized
        else:
            layer_schemes = {n[len(layer_prefix):]: s for n, s in schemes.items() if n.startswith(layer_prefix)}
            ctx = LayerContext(index=i, layer=layer, prefix=layer_prefix, adapter=adapter, config=model.config,
                               schemes=layer_schemes, inputs=inputs, run_layer=run_layer)
            if len(inputs) == 1 and runs_in_one_pass(quantizer):
                layer_results, outputs = _quantize_layer_in_one_pass(ctx, quantizer, device, compute_dtype, scratch)
            else:
                layer_results = _quantize_layer(ctx, quantizer, needs_data, device, compute_dtype)
        if needs_data:
            with torch.no_grad():
                outputs = run_layer() if outputs is None else outputs
                inputs[:] = [(out, kwargs) for out, (_, kwargs) in zip(outputs, inputs)]
            del outputs
        if i not in done:
            quantizer.end_layer(ctx)
        if store is not None and i not in done:  # saved before the layer returns to its storage dtype
            store.save_layer(LayerRecord(index=i, quantized=layer_results, other=_other_tensors(layer, layer_prefix, layer_results)))
        if release_layers and layer_source is None:
            _release_layer(stored)
        else:
            _write_back(layer, stored)
        del stored
        finished.update(layer_results)
        if store is None:
            results.update(layer_results)
        del layer_results
        if layer_source is not None:
            layer_source.release(i)
        else:
            trim_heap()  # the layer's freed temporaries and replaced weights go back to the OS
        bar.set_postfix(layer_s=f"{time.perf_counter() - t0:.2f}")
    missing = set(schemes) - finished
    if missing:
        raise QuantkitError(f"{len(missing)} target linears lie outside the decoder layers (e.g. {sorted(missing)[0]}); add them to --ignore")
    return results


def _quantize_layer(ctx: LayerContext, quantizer: Quantizer, needs_data: bool, device, compute_dtype) -> dict[str, QuantizedWeight]:
    """begin_layer, then each stage: observe its linears' inputs, quantize, fake-quantize in place."""
    quantizer.begin_layer(ctx)
    layer_results = {}
    for stage in _target_stages(ctx, quantizer):
        modules = {n: ctx.layer.get_submodule(n) for n in stage}
        if needs_data and quantizer.needs_observe:
            _observe_stage(ctx.layer, modules, quantizer, ctx.inputs, device, compute_dtype)
        for n, m in modules.items():
            layer_results[ctx.prefix + n] = _to_cpu(_quantize_in_place(ctx, quantizer, n, m))
    return layer_results


def _target_stages(ctx: LayerContext, quantizer: Quantizer) -> list[list[str]]:
    """The quantizer's stages restricted to this layer's target linears, empty stages dropped."""
    stages = [[n for n in stage if n in ctx.schemes] for stage in quantizer.stages(ctx)]
    return [stage for stage in stages if stage]


@torch.no_grad()
def _quantize_in_place(ctx: LayerContext, quantizer: Quantizer, name: str, module: nn.Module) -> QuantizedWeight:
    """Quantize one linear and leave it fake-quantized (its weight replaced by the dequantized
    values), which is what everything downstream in the calibration must see."""
    qw = quantizer.quantize_linear(name, module, ctx.schemes[name])
    _check_finite(ctx.prefix + name, qw)
    module.weight.data = qw.dequantize(module.weight.dtype).to(module.weight.device)
    return qw


@torch.no_grad()
def _quantize_layer_in_one_pass(ctx: LayerContext, quantizer: Quantizer, device, compute_dtype,
                                scratch: Optional["ScratchBuffers"] = None):
    """True-sequential in one forward over the single calibration batch: each target linear's
    pre-hook observes its input, quantizes it and fake-quantizes it in place, so everything after it
    in the forward (later stages, the layer's output) already sees it quantized. The staged
    driver's result when each stage's linears share one input and stages follow the forward order,
    which the hooks check; returns the results and the layer's outputs (no extra pass for the next
    layer). A gated MLP runs in token chunks (`_run_in_token_chunks`). In a sequential block (the
    Llama family: attention, then MLP, each added to the residual) the norms' outputs share one
    `scratch` buffer and the attention's output and the MLP's products another: none of them
    outlives the next one's start there."""
    quantizer.begin_layer(ctx)
    state = _InForward(ctx, quantizer)
    handles = [m.register_forward_pre_hook(state.pre_hook(n)) for n, m in state.modules.items()]
    mlp = ctx.adapter.gated_mlp(ctx.layer)
    sequential = mlp is not None and mlp.sequential_residual
    state.scratch = scratch = scratch if sequential else None
    restore_mlp = _run_in_token_chunks(ctx.layer, mlp, state) if mlp else None
    attention = ctx.adapter.attention(ctx.layer)
    restore_attention = _run_attention_in_sequence_chunks(ctx.layer, attention, state) if attention else None
    restore_norms = _run_norms_in_row_chunks(ctx.layer, _norm_names(ctx), scratch)
    (hidden, kwargs), = ctx.inputs
    home = hidden.device
    # the layer's input goes from the list (its output will replace it) and is passed by `.forward`,
    # which, unlike `__call__`, keeps no reference to its arguments: the decoder layer drops it after
    # the attention residual, 75 MB less through the MLP on the demo calibration set
    args = [_to(hidden, device).to(compute_dtype)]
    ctx.inputs[0] = (None, kwargs)
    del hidden
    if sequential:
        state.layer_input = args[0]  # freed when the MLP starts (transformers' forward wrappers hold it)
    try:
        out = ctx.layer.forward(args.pop(), **_to(kwargs, device))
    finally:
        for h in handles:
            h.remove()
        if restore_mlp:
            restore_mlp()
        if restore_attention:
            restore_attention()
        restore_norms()
    missing = [n for n in state.stage_of if n not in state.results]
    if missing:
        state.fail(f"{missing[0]} never ran in the forward")
    return ({ctx.prefix + n: _to_cpu(state.results[n]) for stage in state.stages for n in stage},
            [_layer_output(out).to(home)])


class _InForward:
    """The one-pass driver's bookkeeping for one layer: the stage now open, its input, the results.

    At a stage's first linear the quantizer observes every linear of the stage with that input (as
    the staged driver does before quantizing any; GPTQ then solves linears sharing a Hessian
    together); the stage's other linears must then run on that very tensor. Only the open stage's
    input is held, and only until the stage is quantized, so no stage input outlives its use."""

    def __init__(self, ctx: LayerContext, quantizer: Quantizer):
        self.ctx, self.quantizer = ctx, quantizer
        self.stages = _target_stages(ctx, quantizer)
        self.stage_of = {n: k for k, stage in enumerate(self.stages) for n in stage}
        self.modules = {n: ctx.layer.get_submodule(n) for n in self.stage_of}
        self.results: dict[str, QuantizedWeight] = {}
        self.open_stage: Optional[int] = None
        self.open_input: Optional[torch.Tensor] = None
        self.layer_input: Optional[torch.Tensor] = None  # the decoder layer's input, where it may be freed early
        self.scratch: Optional[ScratchBuffers] = None  # set for a sequential block (see _quantize_layer_in_one_pass)

    def free_layer_input(self, keep: torch.Tensor) -> None:
        """Free the decoder layer's input (the adapter says the layer reads it no more): 75 MB less
        through the MLP on the demo calibration set. Its storage is emptied in place, as references
        to it outlive its use; anything that still read it would fail loudly, not read stale data."""
        x, self.layer_input = self.layer_input, None
        if x is not None and x.untyped_storage().data_ptr() != keep.untyped_storage().data_ptr():
            x.untyped_storage().resize_(0)

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
        """More rows of the open stage's input (a chunked MLP hands down's input over in chunks)."""
        for n in self.stages[self.stage_of[name]]:
            self.quantizer.observe(n, self.modules[n], x)

    def quantize(self, name: str) -> None:
        self.results[name] = _quantize_in_place(self.ctx, self.quantizer, name, self.modules[name])
        if all(n in self.results for n in self.stages[self.open_stage]):
            self.open_input = None

    def pre_hook(self, name: str):
        def hook(module, args):
            self.enter(name, args[0])
            self.quantize(name)

        return hook


# the one-pass forward's scratch slots: the norms' outputs, and the attention's output / MLP products
NORM_SLOT, BIG_SLOT = "norm", "big"


class ScratchBuffers:
    """Named buffers that every layer's one-pass forward reuses for its big intermediates.

    Why: a tensor above glibc's mmap threshold (32 MiB) is a fresh mapping, page-faulted in on first
    write and unmapped when freed, so every layer paid for its 75-200 MB intermediates afresh: on
    the demo's CPU an elementwise op writing into fresh memory ran ~4x slower than into reused
    memory (~25 ms per 75 MB). A slot's buffer only grows; the caller guarantees that what a slot
    held is dead before the slot is taken again."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, slot: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor of `shape` with `like`'s dtype and device, in `slot`'s buffer."""
        numel = math.prod(shape)
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            self._buffers.pop(slot, None)  # the old one goes before the new one arrives
            buf = self._buffers[slot] = like.new_empty(numel)
        return buf[:numel].view(shape)


def _empty(scratch: Optional[ScratchBuffers], slot: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor for a `slot` intermediate: from `scratch` when given, else fresh."""
    return like.new_empty(shape) if scratch is None else scratch.take(slot, shape, like)


def _override_forward(module: nn.Module, forward) -> callable:
    """Give `module` an instance-level `forward` for one calibration forward; returns the undo,
    which puts back the instance-level forward it had (accelerate's hooks set one), if any."""
    previous = module.__dict__.get("forward")
    module.forward = forward

    def restore():
        if previous is None:
            del module.forward
        else:
            module.forward = previous

    return restore


# size of one chunk's gate (and up, act) when the one-pass driver runs a gated MLP in token chunks:
# a few MB stay in cache from the GEMM to the activation and the product (the demo's MLP forward:
# 1.61 s whole, ~1.35 s in 1024-2048-row chunks), and are reused from the heap instead of being
# page-faulted in afresh; at least MLP_CHUNK_MIN_ROWS rows, so the GEMMs stay efficient
MLP_CHUNK_BYTES = 8 << 20
MLP_CHUNK_MIN_ROWS = 256


def _act_in_place(act: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """act(x) over x itself where the activation is SiLU (the Llama family's): no temporary."""
    if isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return F.silu(x, inplace=True)
    return act(x)


def _run_in_token_chunks(layer: nn.Module, spec, state: _InForward) -> callable:
    """Make the layer's gated MLP run in token chunks for one forward; returns the undo.

    gate and up still see the whole input at once; gate, up and act(gate) exist one chunk at a time,
    each chunk's product goes into one buffer and is handed to the quantizer as down's input rows,
    and down, once quantized, runs as one GEMM over the buffer."""
    mlp = layer.get_submodule(spec.module)
    gate, up, down = (layer.get_submodule(n) for n in (spec.gate, spec.up, spec.down))
    act = layer.get_submodule(spec.act)

    def forward(x: torch.Tensor) -> torch.Tensor:
        state.free_layer_input(keep=x)  # set only for a sequential_residual block
        flat = x.reshape(-1, x.shape[-1])
        for name, module in ((spec.gate, gate), (spec.up, up)):
            if name in state.modules:
                state.enter(name, flat)
                state.quantize(name)
        rows = max(MLP_CHUNK_MIN_ROWS, MLP_CHUNK_BYTES // (gate.out_features * flat.element_size()))
        trim_heap()  # the attention's freed temporaries go back before the products arrive
        starts = range(0, flat.shape[0], rows)
        gate_up = _stacked_linear(gate, up)
        # one allocation (a mapping of its own, returned whole when freed), so the products never
        # fragment the heap that the chunks' temporaries are reused from
        products = _empty(state.scratch, BIG_SLOT, (flat.shape[0], gate.out_features), flat)
        for start in starts:  # .forward: the chunks bypass the pre-hooks
            chunk, product = flat[start:start + rows], products[start:start + rows]
            if gate_up is not None:
                g, u = gate_up(chunk).split(gate.out_features, dim=-1)
                torch.mul(_act_in_place(act, g), u, out=product)
            else:
                torch.mul(act(gate.forward(chunk)), up.forward(chunk), out=product)
            if spec.down in state.modules:  # the first chunk opens down's stage, the rest add rows
                if start:
                    state.observe_more(spec.down, product)
                else:
                    state.enter(spec.down, product)
        if spec.down in state.modules:
            state.quantize(spec.down)
        # every row of x is consumed by now: a sequential block's MLP output may take its place
        fits = spec.sequential_residual and down.out_features == flat.shape[-1] and flat.is_contiguous()
        out = flat if fits else flat.new_empty(flat.shape[0], down.out_features)
        # down as one GEMM over the whole product (~20 % faster than per chunk on the demo, and no
        # per-chunk output temporaries)
        if type(down) is not nn.Linear:
            out.copy_(down.forward(products))
        elif down.bias is None:
            torch.matmul(products, down.weight.t(), out=out)
        else:
            torch.addmm(down.bias, products, down.weight.t(), out=out)
        return out.view(*x.shape[:-1], down.out_features)

    return _override_forward(mlp, forward)


# hidden-state bytes of one chunk of sequences when the one-pass driver runs a decoder layer's
# attention a few sequences at a time (~7 of the demo's 512-token sequences): each temporary stays
# below glibc's mmap threshold, so it is reused from the heap instead of being page-faulted in
# afresh (the whole-batch attention's dozen 75 MB temporaries cost ~1.4 s of page faults per layer)
ATTN_CHUNK_BYTES = 8 << 20
# arguments of transformers' attention forward whose first dimension is the batch
_BATCHED_ATTENTION_ARGS = ("attention_mask", "position_embeddings", "position_ids")


def _run_attention_in_sequence_chunks(layer: nn.Module, spec, state: _InForward) -> callable:
    """Make the layer's self-attention run a few sequences at a time for one forward; returns the undo.

    The input projections still observe the whole input and are quantized before any chunk runs;
    each chunk then runs transformers' own attention forward with the projections' hooks set aside
    and the output projection capturing its input rows; once all sequences have attended, the
    output projection observes the whole attention output, is quantized, and runs. A call this
    does not understand (a KV cache, an unexpected batch-shaped argument) runs whole."""
    attn = layer.get_submodule(spec.module)
    output = layer.get_submodule(spec.output)
    hooked = [layer.get_submodule(n) for n in (*spec.inputs, spec.output) if n in state.modules]
    original = attn.forward

    def forward(hidden_states: torch.Tensor, *args, **kwargs):
        batch = hidden_states.shape[0]
        splittable = (not args and hidden_states.dim() == 3 and kwargs.get("cache") is None
                      and kwargs.get("past_key_values") is None
                      and not any(k not in _BATCHED_ATTENTION_ARGS and _has_batch_dim(v, batch)
                                  for k, v in kwargs.items()))
        seqs = max(1, ATTN_CHUNK_BYTES // max(1, hidden_states[0].numel() * hidden_states.element_size()))
        if not splittable or seqs >= batch:
            return original(hidden_states, *args, **kwargs)
        for name in spec.inputs:
            if name in state.modules:
                state.enter(name, hidden_states)
                state.quantize(name)
        attended: Optional[torch.Tensor] = None  # the output projection's whole input, filled chunk by chunk
        filled = 0

        def capture(x: torch.Tensor) -> torch.Tensor:
            nonlocal attended, filled
            if attended is None:
                attended = _empty(state.scratch, BIG_SLOT, (batch, *x.shape[1:]), x)
            attended[filled:filled + x.shape[0]] = x
            filled += x.shape[0]
            return x.new_empty(0)  # the attention forward returns it unread

        saved_hooks = [dict(m._forward_pre_hooks) for m in hooked]
        for m in hooked:
            m._forward_pre_hooks.clear()
        restore_output = _override_forward(output, capture)
        try:
            for start in range(0, batch, seqs):
                part = slice(start, start + seqs)
                result = original(hidden_states[part], **{k: _batch_slice(v, part, batch)
                                                          if k in _BATCHED_ATTENTION_ARGS else v
                                                          for k, v in kwargs.items()})
        finally:
            restore_output()
            for m, hooks in zip(hooked, saved_hooks):
                m._forward_pre_hooks.update(hooks)
        if filled != batch:
            state.fail(f"{spec.output} did not run on every sequence of the attention")
        if spec.output in state.modules:
            state.enter(spec.output, attended)
            state.quantize(spec.output)
        out = _project_in_place(output, attended)
        # the rest of the forward's result (attention weights: None under SDPA) is per chunk: not returned
        return (out, *(None for _ in result[1:])) if isinstance(result, tuple) else out

    return _override_forward(attn, forward)


def _project_in_place(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(x) for a square nn.Linear, written over x one row chunk at a time (each chunk's rows
    are consumed by its own GEMM first): no fresh whole-batch output, whose page faults made the
    demo's o_proj ~25 % slower than the same GEMM chunked. Anything else runs as usual."""
    if type(linear) is not nn.Linear or linear.in_features != linear.out_features or not x.is_contiguous():
        return linear.forward(x)
    rows = x.view(-1, x.shape[-1])
    chunk = max(MLP_CHUNK_MIN_ROWS, ATTN_CHUNK_BYTES // (rows.shape[1] * rows.element_size()))
    for start in range(0, rows.shape[0], chunk):
        part = rows[start:start + chunk]
        part.copy_(linear.forward(part))
    return x


# rows of a norm's input per chunk when the one-pass driver runs a decoder layer's norms in row
# chunks: their fp32 temporaries (x², x·rsqrt, the scaled output) stay cache-sized heap blocks
NORM_CHUNK_BYTES = 8 << 20


def _norm_names(ctx: LayerContext) -> list[str]:
    """The layer's norms feeding its linears (the adapter's folding groups name them)."""
    try:
        groups = ctx.adapter.input_groups(ctx.layer)
    except (QuantkitError, NotImplementedError):
        return []
    return [g.prev for g in groups if g.kind == NORM]


def _fused_rms_norm(norm: nn.Module):
    """The norm as one fused `F.rms_norm` (plus its weight, written into `out`), for a Llama-style
    RMSNorm in fp32 (weight * x * rsqrt(mean(x^2) + eps)); None when the module does not look like
    one. The caller still checks it against the module's own forward before trusting it."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.dtype != torch.float32 \
            or not isinstance(eps, float) or getattr(norm, "bias", None) is not None:
        return None
    shape = (weight.shape[0],)

    def run(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return torch.mul(weight, F.rms_norm(x, shape, None, eps), out=out)

    return run


def _run_norms_in_row_chunks(layer: nn.Module, names: list[str], scratch: Optional["ScratchBuffers"] = None) -> callable:
    """Make the layer's norms (RMSNorm, LayerNorm: each row on its own) compute a few thousand rows
    at a time into one output for one forward; returns the undo. Only the output is whole: the
    norm's own temporaries (three more tensors of the input's size for transformers' RMSNorm) are
    never allocated for the whole calibration set. A Llama-style RMSNorm whose fused form
    (`_fused_rms_norm`) gives the first chunk bit for bit as its own forward does runs fused for
    the rest (the demo's norms ~5x faster: 20 vs 99 ms per layer's norm). With `scratch` every norm's
    output goes to its one NORM_SLOT buffer (for a block whose norm outputs never coexist)."""
    undo = []
    for name in names:
        norm = layer.get_submodule(name)
        original = norm.forward
        fused = _fused_rms_norm(norm)

        def forward(x: torch.Tensor, original=original, fused=fused) -> torch.Tensor:
            flat = x.reshape(-1, x.shape[-1])
            rows = max(1, NORM_CHUNK_BYTES // max(1, x.shape[-1] * x.element_size()))
            if flat.shape[0] <= rows:
                return original(x)
            first = original(flat[:rows])
            out = _empty(scratch, NORM_SLOT, (flat.shape[0], first.shape[-1]), first)
            out[:rows] = first
            if fused is not None and (x.dtype != torch.float32 or first.dtype != torch.float32
                                      or not torch.equal(fused(flat[:rows], out=torch.empty_like(first)), first)):
                fused = None
            del first
            for start in range(rows, flat.shape[0], rows):
                if fused is not None:
                    fused(flat[start:start + rows], out=out[start:start + rows])
                else:
                    out[start:start + rows] = original(flat[start:start + rows])
            return out.view(*x.shape[:-1], out.shape[-1])

        undo.append(_override_forward(norm, forward))

    def restore():
        for restore_one in undo:
            restore_one()

    return restore


def _batch_first(value, batch: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch


def _has_batch_dim(value, batch: int) -> bool:
    values = value if isinstance(value, (tuple, list)) else (value,)
    return any(_batch_first(v, batch) for v in values)


def _batch_slice(value, part: slice, batch: int):
    """``value[part]`` for a tensor (or tuple of tensors) with the batch first; broadcast ones (1) as they are."""
    if isinstance(value, (tuple, list)):
        return type(value)(_batch_slice(v, part, batch) for v in value)
    return value[part] if _batch_first(value, batch) else value


def _stacked_linear(a: nn.Module, b: nn.Module) -> Optional[callable]:
    """One matmul for two plain linears reading one input (gate and up, already fake-quantized):
    ``x -> [a(x), b(x)]``, ~8 % faster than two on the demo's MLP chunks and, with the stacked rows
    a row-for-row copy, the same numbers (bit for bit with this MKL: the one-pass = staged test);
    None when they are not plain ``nn.Linear`` (an accelerate hook, a quantized module)."""
    plain = all(type(m) is nn.Linear and "forward" not in m.__dict__ for m in (a, b))
    if not plain or (a.bias is None) != (b.bias is None) or a.weight.device != b.weight.device \
            or a.weight.dtype != b.weight.dtype or a.weight.device.type == "meta":
        return None
    weight = torch.cat([a.weight, b.weight])
    bias = None if a.bias is None else torch.cat([a.bias, b.bias])
    return lambda x: F.linear(x, weight, bias)


def _other_tensors(layer, layer_prefix: str, quantized: dict[str, QuantizedWeight]) -> dict[str, torch.Tensor]:
    """Every tensor of the layer that is not a quantized linear's weight/bias (norms, ignored linears)."""
    skip = {f"{name[len(layer_prefix):]}.{t}" for name in quantized for t in ("weight", "bias")}
    return {layer_prefix + k: v.detach().cpu().clone() for k, v in layer.state_dict().items() if k not in skip}


def _restore_layer(layer, layer_prefix: str, record: LayerRecord) -> None:
    """Put a saved layer back: fake-quantized linears from their results, everything else as saved."""
    with torch.no_grad():
        for name, qw in record.quantized.items():
            m = layer.get_submodule(name[len(layer_prefix):])
            m.weight.data = qw.dequantize(m.weight.dtype).to(m.weight.device)
        state = {k[len(layer_prefix):]: v for k, v in record.other.items()}
        missing = [k for k in state if k not in layer.state_dict()]
        if missing:
            raise QuantkitError(f"--resume: saved layer {record.index} does not match the model (tensor {missing[0]})")
        for k, v in state.items():
            target = layer.get_parameter(k) if k in dict(layer.named_parameters()) else layer.get_buffer(k)
            target.data = v.to(device=target.device, dtype=target.dtype)


@torch.no_grad()
def _observe_stage(layer, modules: dict, quantizer: Quantizer, inputs: list, device, compute_dtype) -> None:
    """Feed the stage's linears' inputs to the quantizer, stopping each batch's forward as soon as
    every linear of the stage has been seen: the rest of the layer is not needed yet (for the first
    stage that skips almost the whole layer), which roughly halves true-sequential calibration."""
    seen: set[str] = set()

    def observer(name):
        def hook(module, args):
            quantizer.observe(name, module, args[0])  # the very tensor: q/k/v share it by identity (no_grad)
            seen.add(name)
            if len(seen) == len(modules):
                raise _StopForward

        return hook

    handles = [m.register_forward_pre_hook(observer(n)) for n, m in modules.items()]
    try:
        for hidden, kwargs in inputs:
            seen.clear()
            try:
                layer(_to(hidden, device).to(compute_dtype), **_to(kwargs, device))
            except _StopForward:
                pass
    finally:
        for h in handles:
            h.remove()


def _check_finite(name: str, qw: QuantizedWeight) -> None:
    if not torch.isfinite(qw.scales).all():
        raise QuantkitError(f"quantizing {name} produced non-finite scales; the calibration data or weights contain NaN/inf")


def _to_cpu(qw: QuantizedWeight) -> QuantizedWeight:
    from dataclasses import replace

    return replace(qw, qweight=qw.qweight.cpu(), scales=qw.scales.cpu(), zeros=qw.zeros.cpu(), g_idx=qw.g_idx.cpu(),
                   bias=None if qw.bias is None else qw.bias.detach().cpu())
