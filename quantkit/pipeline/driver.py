"""The layer-by-layer calibration pipeline. It knows nothing of any one method: a recipe does the work.

It captures what enters decoder layer 0 (hidden states and every keyword argument: masks, position
ids, rotary tables), then per layer: load the layer (onto the compute device, in fp32; from disk when
streaming) -> run a strategy (the recipe's transforms, then its weight quantizer, stage by stage or in
one pass; a layer already in the progress store is restored instead) -> the layer's quantized
outputs become the next layer's inputs (its unquantized outputs, for a recipe that calibrates on the
original model's hidden states, e.g. AWQ's) -> persist its results (progress store) -> release it
(written back into the model, or dropped and its pages handed back). Only one decoder layer lives on
the compute device; activations stay on `activation_device`.
"""
from __future__ import annotations

import copy
import time
from typing import Optional

import torch
from tqdm.auto import tqdm

from quantkit.errors import QuantkitError
from quantkit.pipeline import residency
from quantkit.pipeline.batching import runs_in_one_pass
from quantkit.pipeline.capture import capture_layer_inputs, run_layer
from quantkit.pipeline.experts import ExpertPolicy, experts_unfused, strategy_needs_stages
from quantkit.pipeline.memory_policy import MemoryPolicy, memory_policy
from quantkit.pipeline.one_pass import OnePassStrategy
from quantkit.pipeline.staged import StagedStrategy
from quantkit.progress import LayerRecord, ProgressStore
from quantkit.qtensor import QuantizedWeight
from quantkit.quantizers.base import LayerContext
from quantkit.quantizers.recipe import Recipe
from quantkit.reduction import Comm, LocalComm, SampleLayout
from quantkit.scheme import LinearScheme


class LayerByLayer:
    """One calibration run over a model's decoder layers (see the module docstring)."""

    def __init__(self, model, adapter, recipe: Recipe, schemes: dict[str, LinearScheme], input_ids, *, device,
                 activation_device, compute_dtype, batch_size: int, store: Optional[ProgressStore], layer_source,
                 release_layers: bool, policy: MemoryPolicy, experts: Optional[ExpertPolicy] = None,
                 comm: Optional[Comm] = None):
        if release_layers and store is None:
            raise ValueError("release_layers needs a store: the results live only there")
        if recipe.needs_calibration and input_ids is None:
            raise QuantkitError(f"method {recipe.name!r} needs calibration data; pass --dataset")
        self.model, self.adapter, self.recipe, self.schemes = model, adapter, recipe, schemes
        self.device, self.activation_device, self.compute_dtype = device, activation_device, compute_dtype
        self.store, self.layer_source, self.release_layers, self.policy = store, layer_source, release_layers, policy
        self.expert_policy = experts or ExpertPolicy()
        self.layer_stats: dict[int, dict] = {}  # per layer: what its MoE experts were calibrated on
        self.layers = adapter.decoder_layers(model)
        self.prefix = adapter.layers_prefix(model)
        self.done = set(store.done_layers()) if store is not None else set()
        # this process's share of the calibration set (all of it unless data-parallel), in batches
        self.comm = comm or LocalComm()
        self.samples = (SampleLayout.build(self.comm, input_ids.shape[0], input_ids.shape[1], batch_size)
                        if recipe.needs_calibration else None)
        self.inputs = (capture_layer_inputs(model, adapter, input_ids, batch_size, device, activation_device,
                                            compute_dtype, batches=self.samples.batches) if recipe.needs_calibration else [])
        # the unquantized model's hidden states beside the quantized ones, for steps that compare with them
        self.reference = [h.clone() for h, _ in self.inputs] if recipe.needs_reference_inputs else None
        # the stream itself is the unquantized one: persist/resume keep it where they keep `reference`
        self.float_stream = recipe.needs_calibration and recipe.calibrates_on_float_inputs
        if self.float_stream and self.reference is not None:
            raise ValueError("a recipe calibrates on the unquantized stream or compares with it, not both")
        # decided for the whole set, not this rank's share: every rank count runs the same strategy
        one_pass = self.samples is not None and batch_size >= self.samples.n_samples and runs_in_one_pass(recipe)
        self.strategy = OnePassStrategy(policy) if one_pass else StagedStrategy()
        self.staged = StagedStrategy()

    def run(self, progress: bool) -> dict[str, QuantizedWeight]:
        if self.release_layers:  # from here on the weights are read one layer at a time (see residency.release)
            self.policy.page_out(self.model.state_dict().values())
        results: dict[str, QuantizedWeight] = {}
        finished: set[str] = set()
        bar = tqdm(range(len(self.layers)), desc=self.recipe.name, unit="layer", disable=not progress)
        for i in bar:
            t0 = time.perf_counter()
            stored = self.load(i)
            with experts_unfused(self.layers[i], self.adapter, self.expert_policy,
                                 calibrated=self.recipe.needs_calibration) as experts:
                restored = i in self.done
                layer_results = self.calibrate(i, experts)
                self.persist(i, layer_results, stored)
            self.release(i, stored)
            finished.update(layer_results)
            if restored:  # a record lists only its quantized linears; the kept ones were finished too
                finished.update(n for n in self.schemes if n.startswith(self.layer_prefix(i)))
            if self.store is None:  # with a store the results live only there (memory flat in depth)
                results.update(layer_results)
            bar.set_postfix(layer_s=f"{time.perf_counter() - t0:.2f}")
        missing = set(self.schemes) - finished
        if missing:
            raise QuantkitError(f"{len(missing)} target linears lie outside the decoder layers (e.g. {sorted(missing)[0]}); "
                                "add them to --ignore")
        return results

    def layer_prefix(self, i: int) -> str:
        return f"{self.prefix}.{i}."

    def device_of(self, i: int) -> torch.device:
        """Where layer i is calibrated: the compute device, or the GPU a device map put it on."""
        return self.layer_source.compute_device(i, self.device) if self.layer_source is not None else self.device

    def load(self, i: int) -> dict:
        """Layer i on its compute device in the compute dtype (read from disk first when streaming)."""
        if self.layer_source is not None:
            self.layer_source.materialize(i)
        return residency.to_compute(self.layers[i], self.device_of(i), self.compute_dtype)

    def calibrate(self, i: int, experts=None) -> dict[str, QuantizedWeight]:
        """Layer i's quantized results (computed, or restored from the store), its outputs passed on."""
        layer, prefix = self.layers[i], self.layer_prefix(i)
        if i in self.done:
            return self.restore(i)
        ctx = LayerContext(index=i, layer=layer, prefix=prefix, adapter=self.adapter, config=self.model.config,
                           schemes={n[len(prefix):]: s for n, s in self.schemes.items() if n.startswith(prefix)},
                           inputs=self.inputs, run_layer=lambda: self.run_layer(i), experts=experts,
                           samples=self.samples)
        float_outputs = self.run_layer(i) if self.float_stream else None  # before any step changes the layer
        self.recipe.begin_layer(ctx)
        if self.reference is not None:  # the layer as the unquantized model has it: transformed, not quantized
            ctx.reference_layer = copy.deepcopy(layer)
            ctx.reference_inputs = [(h, kw) for h, (_, kw) in zip(self.reference, self.inputs)]
        strategy = self.staged if strategy_needs_stages(layer, self.adapter) else self.strategy
        layer_results, outputs = strategy.quantize_layer(ctx, self.recipe, self.device_of(i), self.compute_dtype,
                                                          observe=self.recipe.needs_observe)
        if ctx.reference_layer is not None:  # the unquantized stream moves on (a refiner's targets); its inputs are done
            if ctx.reference_outputs is None:  # the one-pass strategy ran the unquantized layer already
                ctx.reference_outputs = run_layer(ctx.reference_layer, ctx.reference_inputs, self.device_of(i),
                                                  self.compute_dtype, self.activation_device)
            self.reference = ctx.reference_outputs
            ctx.reference_inputs = None
        if self.recipe.refiners:  # the layer's weights improved together; its outputs are then run anew
            layer_results = self.refine(i, ctx, layer_results)
            outputs = None
        self.advance(i, outputs if float_outputs is None else float_outputs)
        ctx.reference_layer = ctx.reference_outputs = None
        self.recipe.end_layer(ctx)
        if experts is not None:
            self.layer_stats.setdefault(i, {}).update(experts=experts.stats(),
                                                      uncalibrated_method=self.recipe.uncalibrated_method)
        self.check_replicas(i)
        return layer_results

    def refine(self, i: int, ctx: LayerContext, layer_results: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
        """Layer i's results as the refiners leave them; what they report is kept in the layer's stats
        (persisted with the layer, so a resumed run reports every layer)."""
        layer_results = self.recipe.refine_layer(ctx, layer_results, self.device_of(i), self.compute_dtype)
        reports = self.recipe.layer_reports(i)
        if reports:
            self.layer_stats.setdefault(i, {})["refiners"] = reports
        return layer_results

    def check_replicas(self, i: int) -> None:
        """Every data-parallel rank must now hold the same layer i: what quantkit.reduction promises
        for statistics reduced through it, checked (a custom step may keep its own)."""
        if self.comm.world > 1 and not self.comm.agree(residency.digest(self.layers[i])):
            raise QuantkitError(f"layer {i}: the data-parallel ranks hold different quantized layers: a step of recipe "
                                f"{self.recipe.name!r} keeps statistics outside quantkit.reduction; run it in one process")

    def run_layer(self, i: int) -> list:
        return run_layer(self.layers[i], self.inputs, self.device_of(i), self.compute_dtype, self.activation_device)

    @torch.no_grad()
    def advance(self, i: int, outputs: Optional[list]) -> None:
        """The (quantized) layer's outputs replace its inputs: what the next layer calibrates on."""
        if not self.recipe.needs_calibration:
            return
        outputs = self.run_layer(i) if outputs is None else outputs
        self.inputs[:] = [(out, kwargs) for out, (_, kwargs) in zip(outputs, self.inputs)]

    def restore(self, i: int) -> dict[str, QuantizedWeight]:
        """Layer i as the store holds it (a resumed run), and the streams after it."""
        record = self.store.load_layer(i)
        residency.restore(self.layers[i], self.layer_prefix(i), record)
        self.layer_stats[i] = record.stats
        if self.float_stream:  # the restored layer is quantized: its unquantized outputs were saved
            hidden = self.saved_stream(i, [h for h, _ in self.inputs])
            if hidden is None:
                raise QuantkitError(f"--resume: the staging folder has no unquantized hidden states after layer "
                                    f"{i}; delete it and start over")
            self.inputs[:] = [(h.to(old.device, old.dtype), kw) for h, (old, kw) in zip(hidden, self.inputs)]
        else:
            self.advance(i, None)
        if self.reference is not None:
            self.reference = self.saved_stream(i, self.reference) or self.reference
        return record.quantized

    def saved_stream(self, i: int, like: list) -> Optional[list]:
        """The unquantized hidden states persist saved after layer i, cut into batches shaped like
        `like`'s (this process's rows of them); None when the store has none."""
        saved = self.store.load_reference(i)
        return split_rows(join_rows(saved), like) if saved else None

    def persist(self, i: int, layer_results: dict[str, QuantizedWeight], stored: dict) -> None:
        """Saved before the layer returns to its storage dtype (resume restores exactly this). A result that
        keeps its linear in full precision (a float preset's transform pass: `full_precision`) is saved as
        the layer's other tensors are, its weight in the layer's storage dtype (what writing it back gives)."""
        if self.store is not None and i not in self.done:
            if self.reference is not None:  # before the record: a saved layer always has its reference
                self.store.save_reference(i, [join_rows(self.reference)])
            elif self.float_stream:
                self.store.save_reference(i, [join_rows([h for h, _ in self.inputs])])
            prefix = self.layer_prefix(i)
            kept = {n for n, r in layer_results.items() if getattr(r, "full_precision", False)}
            quantized = {n: r for n, r in layer_results.items() if n not in kept}
            other = residency.other_tensors(self.layers[i], prefix, quantized)
            if kept:
                residency.to_storage_dtype_(other, kept, stored)
            self.store.save_layer(LayerRecord(index=i, quantized=quantized, other=other,
                                              stats=self.layer_stats.get(i, {})))

    def release(self, i: int, stored: dict) -> None:
        if self.release_layers and self.layer_source is None:
            residency.release(stored, self.policy)
        else:
            residency.write_back(self.layers[i], stored)
        stored.clear()
        if self.layer_source is not None:
            self.layer_source.release(i)
        else:
            self.policy.trim_heap()  # the layer's freed temporaries and replaced weights go back to the OS


def join_rows(batches: list) -> torch.Tensor:
    """A list of per-batch hidden states as one tensor of this process's samples, in order."""
    return batches[0] if len(batches) == 1 else torch.cat(batches)


def split_rows(whole: torch.Tensor, like: list) -> list:
    """`whole` (this process's samples, in order) cut into batches shaped like `like`'s."""
    return list(whole.split([t.shape[0] for t in like]))


def quantize_model(model, adapter, recipe, schemes: dict[str, LinearScheme], input_ids: Optional[torch.Tensor],
                   device: torch.device | str = "cpu", activation_device: torch.device | str = "cpu",
                   compute_dtype: torch.dtype = torch.float32, batch_size: int = 8, progress: bool = True,
                   store: Optional[ProgressStore] = None, layer_source=None, release_layers: bool = False,
                   policy: Optional[MemoryPolicy] = None, experts: Optional[ExpertPolicy] = None,
                   stats: Optional[dict] = None, comm: Optional[Comm] = None) -> dict[str, QuantizedWeight]:
    """Quantize every linear named in `schemes` (full names) with `recipe` (a Recipe, or one step:
    see `Recipe.of`) and return their QuantizedWeights.

    The model's linears are left fake-quantized (weights replaced by their dequantized values), which
    is exactly what the next layer must see during calibration. With a `store`, each finished layer is
    saved and layers already there are restored instead of recomputed (resume), and the returned dict
    stays empty: the results live only in the store (the checkpoint writer reads them there), so
    memory does not grow with the model's depth. With a `layer_source` (streaming), a layer's weights
    are read from disk only while it is processed. With `release_layers` (needs a `store`; what
    `quantize` does) each finished layer's tensors are dropped instead, leaving the model's layers on
    the meta device. MoE layers are calibrated per expert (`experts`: the few-token policy, see
    quantkit.pipeline.experts); pass a dict as `stats` to receive, per layer index, the tokens each
    expert was calibrated on and which were quantized without calibration. With a `comm` of several
    data-parallel ranks (every rank passes the whole `input_ids`), each rank calibrates its share of
    the samples and the steps' statistics are reduced across the ranks (quantkit.reduction): every
    rank ends with the same results."""
    run = LayerByLayer(model, adapter, Recipe.of(recipe), schemes, input_ids, device=device,
                       activation_device=activation_device, compute_dtype=compute_dtype, batch_size=batch_size,
                       store=store, layer_source=layer_source, release_layers=release_layers,
                       policy=policy or memory_policy(), experts=experts, comm=comm)
    results = run.run(progress)
    if stats is not None:
        stats.update(run.layer_stats)
    return results


@torch.no_grad()
def transform_model(model, transform, input_ids: torch.Tensor, batch_size: int = 8) -> None:
    """Apply one transform (SmoothQuant smoothing, AWQ scales) to every decoder layer of a CPU float
    model in place, without quantizing anything: to check its invariance, or to hand the transformed
    model to another tool. The transform's own log (e.g. `search_log`) says what it chose."""
    from quantkit.models import get_adapter

    adapter = get_adapter(model)
    samples = SampleLayout.local(input_ids.shape[0], input_ids.shape[1], batch_size)
    inputs = capture_layer_inputs(model, adapter, input_ids, batch_size, "cpu", "cpu", batches=samples.batches)
    prefix = adapter.layers_prefix(model)
    for i, layer in enumerate(adapter.decoder_layers(model)):
        with experts_unfused(layer, adapter, ExpertPolicy(), calibrated=True) as experts:
            schemes = {n: transform_scheme(transform) for n in adapter.linear_names(layer)}
            ctx = LayerContext(index=i, layer=layer, prefix=f"{prefix}.{i}.", adapter=adapter, config=model.config,
                               schemes=schemes, inputs=inputs, experts=experts, samples=samples,
                               run_layer=lambda layer=layer: run_layer(layer, inputs, "cpu", torch.float32, "cpu"))
            transform.begin_layer(ctx)
            inputs[:] = [(out, kw) for out, (_, kw) in zip(ctx.run_layer(), inputs)]


def transform_scheme(transform) -> LinearScheme:
    """The scheme a transform's searches simulate when applied on its own: its method's default."""
    d = {"bits": 4, "group_size": -1, "sym": True, **transform.default_scheme}
    return LinearScheme(bits=d["bits"], group_size=d["group_size"], sym=d["sym"])
