"""The one-pass forward's memory-shaped pieces: a decoder layer's gated MLP run in token chunks, its
self-attention a few sequences at a time, its norms a few thousand rows at a time.

Why: with every temporary a few MB, the heap reuses them instead of the kernel page-faulting fresh
zeroed pages for each whole-batch temporary (the demo: ~1.4 s of system time per layer). Each
`run_*` swaps in an instance-level forward for one calibration forward and returns its undo. They
report to the one-pass bookkeeping (`OnePassLayer`: `enter`, `observe_more`, `quantize`) so the
recipe still sees every target linear's whole input before the linear is quantized.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.models.base import NORM
from quantkit.models.fast_ops import act_in_place, fused_rms_norm
from quantkit.pipeline.memory_policy import ScratchBuffers, empty

# the one-pass forward's scratch slots: the norms' outputs, and the attention's output / MLP products
NORM_SLOT, BIG_SLOT = "norm", "big"
# size of one chunk's gate (and up, act) when a gated MLP runs in token chunks: a few MB stay in
# cache from the GEMM to the activation and the product (the demo's MLP forward: 1.61 s whole,
# ~1.35 s in 1024-2048-row chunks); at least MLP_CHUNK_MIN_ROWS rows, so the GEMMs stay efficient
MLP_CHUNK_BYTES = 8 << 20
MLP_CHUNK_MIN_ROWS = 256
# hidden-state bytes of one chunk of sequences for the attention (~7 of the demo's 512-token
# sequences): each temporary stays below glibc's mmap threshold and is reused from the heap
ATTN_CHUNK_BYTES = 8 << 20
# arguments of transformers' attention forward whose first dimension is the batch
BATCHED_ATTENTION_ARGS = ("attention_mask", "position_embeddings", "position_ids")
# rows of a norm's input per chunk: its fp32 temporaries stay cache-sized heap blocks
NORM_CHUNK_BYTES = 8 << 20


def override_forward(module: nn.Module, forward) -> Callable[[], None]:
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


def stacked_linear(a: nn.Module, b: nn.Module) -> Optional[Callable]:
    """One matmul for two plain linears reading one input (gate and up, already fake-quantized):
    ``x -> [a(x), b(x)]``, ~8 % faster than two on the demo's MLP chunks, the same numbers up to
    the GEMM's rounding; None when they are not plain ``nn.Linear`` (an accelerate hook, a
    quantized module)."""
    plain = all(type(m) is nn.Linear and "forward" not in m.__dict__ for m in (a, b))
    if not plain or (a.bias is None) != (b.bias is None) or a.weight.device != b.weight.device \
            or a.weight.dtype != b.weight.dtype or a.weight.device.type == "meta":
        return None
    weight = torch.cat([a.weight, b.weight])
    bias = None if a.bias is None else torch.cat([a.bias, b.bias])
    return lambda x: F.linear(x, weight, bias)


def run_mlp_in_token_chunks(layer: nn.Module, spec, state) -> Callable[[], None]:
    """Make the layer's gated MLP run in token chunks for one forward; returns the undo.

    gate and up still see the whole input at once; gate, up and act(gate) exist one chunk at a time,
    each chunk's product goes into one buffer and is handed to the recipe as down's input rows,
    and down, once quantized, runs as one GEMM over the buffer."""
    mlp = layer.get_submodule(spec.module)
    gate, up, down = (layer.get_submodule(n) for n in (spec.gate, spec.up, spec.down))
    act = layer.get_submodule(spec.act)

    def forward(x: torch.Tensor) -> torch.Tensor:
        state.free_layer_input(keep=x)
        flat = x.reshape(-1, x.shape[-1])
        for name in (spec.gate, spec.up):
            if name in state.modules:
                state.enter(name, flat)
                state.quantize(name)
        state.policy.trim_heap()  # the attention's freed temporaries go back before the products arrive
        # one allocation (a mapping of its own, returned whole when freed), so the products never
        # fragment the heap that the chunks' temporaries are reused from
        products = empty(state.scratch, BIG_SLOT, (flat.shape[0], gate.out_features), flat)
        _fill_products(flat, products, gate, up, act, spec, state)
        if spec.down in state.modules:
            state.quantize(spec.down)
        # every row of x is consumed by now: a sequential block's MLP output may take its place
        fits = state.input_reusable and down.out_features == flat.shape[-1] and flat.is_contiguous()
        out = flat if fits else flat.new_empty(flat.shape[0], down.out_features)
        _down_in_one_gemm(down, products, out)
        return out.view(*x.shape[:-1], down.out_features)

    return override_forward(mlp, forward)


def _fill_products(flat, products, gate, up, act, spec, state) -> None:
    """act(gate(x)) * up(x) chunk by chunk into `products`, each chunk handed to down's observers."""
    rows = max(MLP_CHUNK_MIN_ROWS, MLP_CHUNK_BYTES // (gate.out_features * flat.element_size()))
    gate_up = stacked_linear(gate, up)
    for start, stop in state.row_chunks(flat.shape[0], rows):  # .forward: the chunks bypass the pre-hooks
        chunk, product = flat[start:stop], products[start:stop]
        if gate_up is not None:
            g, u = gate_up(chunk).split(gate.out_features, dim=-1)
            torch.mul(act_in_place(act, g), u, out=product)
        else:
            torch.mul(act(gate.forward(chunk)), up.forward(chunk), out=product)
        if spec.down in state.modules:  # the first chunk opens down's stage, the rest add rows
            if start:
                state.observe_more(spec.down, product)
            else:
                state.enter(spec.down, product)


def _down_in_one_gemm(down: nn.Module, products: torch.Tensor, out: torch.Tensor) -> None:
    """down over the whole product (~20 % faster than per chunk on the demo, no per-chunk outputs)."""
    if type(down) is not nn.Linear:
        out.copy_(down.forward(products))
    elif down.bias is None:
        torch.matmul(products, down.weight.t(), out=out)
    else:
        torch.addmm(down.bias, products, down.weight.t(), out=out)


def _batch_first(value, batch: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch


def _has_batch_dim(value, batch: int) -> bool:
    values = value if isinstance(value, (tuple, list)) else (value,)
    return any(_batch_first(v, batch) for v in values)


def _batch_part(value, part: slice, batch: int):
    """``value[part]`` for a tensor (or tuple of tensors) with the batch first; broadcast ones (1) as they are."""
    if isinstance(value, (tuple, list)):
        return type(value)(_batch_part(v, part, batch) for v in value)
    return value[part] if _batch_first(value, batch) else value


class SequenceChunkedAttention:
    """A decoder layer's self-attention run a few sequences at a time for one forward.

    The input projections still observe the whole input and are quantized before any chunk runs;
    each chunk then runs transformers' own attention forward with the one-pass hooks suspended and
    the output projection capturing its input rows; once all sequences have attended, the output
    projection observes the whole attention output, is quantized, and runs. A call this does not
    understand (a KV cache, an unexpected batch-shaped argument) runs whole."""

    def __init__(self, layer: nn.Module, spec, state):
        self.spec, self.state = spec, state
        self.attn, self.output = layer.get_submodule(spec.module), layer.get_submodule(spec.output)
        self.original = self.attn.forward

    def install(self) -> Callable[[], None]:
        return override_forward(self.attn, self.forward)

    def _splittable(self, hidden_states, args, kwargs) -> bool:
        batch = hidden_states.shape[0]
        return (not args and hidden_states.dim() == 3 and kwargs.get("cache") is None
                and kwargs.get("past_key_values") is None
                and not any(k not in BATCHED_ATTENTION_ARGS and _has_batch_dim(v, batch) for k, v in kwargs.items()))

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        batch, state, spec = hidden_states.shape[0], self.state, self.spec
        seqs = max(1, ATTN_CHUNK_BYTES // max(1, hidden_states[0].numel() * hidden_states.element_size()))
        if not self._splittable(hidden_states, args, kwargs) or seqs >= batch:
            return self.original(hidden_states, *args, **kwargs)
        for name in spec.inputs:
            if name in state.modules:
                state.enter(name, hidden_states)
                state.quantize(name)
        attended, result = self._attend_in_chunks(hidden_states, kwargs, batch, seqs)
        if spec.output in state.modules:
            state.enter(spec.output, attended)
            state.quantize(spec.output)
        out = project_in_place(self.output, attended)
        # the rest of the forward's result (attention weights: None under SDPA) is per chunk: not returned
        return (out, *(None for _ in result[1:])) if isinstance(result, tuple) else out

    def _attend_in_chunks(self, hidden_states, kwargs, batch: int, seqs: int):
        """Every chunk through the attention; returns the output projection's whole input."""
        box = {"attended": None, "filled": 0}

        def capture(x: torch.Tensor) -> torch.Tensor:
            if box["attended"] is None:
                box["attended"] = empty(self.state.scratch, BIG_SLOT, (batch, *x.shape[1:]), x)
            box["attended"][box["filled"]:box["filled"] + x.shape[0]] = x
            box["filled"] += x.shape[0]
            return x.new_empty(0)  # the attention forward returns it unread

        restore_output = override_forward(self.output, capture)
        try:
            with self.state.suspended():
                for start in range(0, batch, seqs):
                    part = slice(start, start + seqs)
                    result = self.original(hidden_states[part], **{
                        k: _batch_part(v, part, batch) if k in BATCHED_ATTENTION_ARGS else v for k, v in kwargs.items()})
        finally:
            restore_output()
        if box["filled"] != batch:
            self.state.fail(f"{self.spec.output} did not run on every sequence of the attention")
        return box["attended"], result


def project_in_place(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
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


def norm_names(adapter, layer) -> list[str]:
    """The layer's norms feeding its linears (the adapter's folding groups name them)."""
    try:
        groups = adapter.input_groups(layer)
    except (QuantkitError, NotImplementedError):
        return []
    return [g.prev for g in groups if g.kind == NORM]


def run_norms_in_row_chunks(layer: nn.Module, names: list[str], scratch: Optional[ScratchBuffers]) -> Callable[[], None]:
    """Make the layer's norms (RMSNorm, LayerNorm: each row on its own) compute a few thousand rows
    at a time into one output for one forward; returns the undo. Only the output is whole: the
    norm's own temporaries are never allocated for the whole calibration set. A Llama-style RMSNorm
    whose fused form gives the first chunk bit for bit as its own forward does runs fused for the
    rest (the demo's norms ~5x faster). With `scratch` every norm's output goes to its one
    NORM_SLOT buffer (for a block whose norm outputs never coexist: checked by the probe)."""
    undo = [override_forward(layer.get_submodule(n), _chunked_norm(layer.get_submodule(n), scratch)) for n in names]

    def restore():
        for restore_one in undo:
            restore_one()

    return restore


def _chunked_norm(norm: nn.Module, scratch: Optional[ScratchBuffers]):
    original, fused = norm.forward, fused_rms_norm(norm)

    def forward(x: torch.Tensor) -> torch.Tensor:
        nonlocal fused
        flat = x.reshape(-1, x.shape[-1])
        rows = max(1, NORM_CHUNK_BYTES // max(1, x.shape[-1] * x.element_size()))
        if flat.shape[0] <= rows:
            return original(x)
        first = original(flat[:rows])
        out = empty(scratch, NORM_SLOT, (flat.shape[0], first.shape[-1]), first)
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

    return forward
