"""Quantization of a model's linears onto a float preset (round-to-nearest or GPTQ on its grid), written as a
compressed-tensors checkpoint (`quantkit quantize --scheme NAME`, see docs/float-schemes.md).

Every preset with a float grid is written: weight-only (NVFP4A16, MXFP4A16), dynamic-activation (FP8_DYNAMIC,
FP8_BLOCK, MXFP4), static-activation (FP8: a per-tensor input_scale; NVFP4: an input_global_scale) and W4AFP8
(int4 group-128 weights by the integer RTN / GPTQ steps, packed pack-quantized, FP8 dynamic per-token inputs).
The static input scales come from each quantized linear's input absmax over the calibration tokens
(`float_codecs.input_scales`): with GPTQ, of the inputs its pipeline observes (everything before the linear
already quantized, as in the checkpoint; no forward of their own); with round-to-nearest, from one forward of
the model as given (`activation_absmax`). So FP8 and NVFP4 need calibration data with either method.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Optional

import torch

from quantkit.errors import QuantkitError
from quantkit.float_codecs import fp8, mxfp4, mxfp8, nvfp4, scale_search
from quantkit.float_codecs.fused_global_scale import shared_global_scales
from quantkit.formats import compressed_tensors, ct_float_quantized, ct_mxfp4, ct_mxfp8, ct_nvfp4, ct_w4afp8
from quantkit.formats.ct_float_layouts import LAYOUTS, args_from_config
from quantkit.formats.registry import float_layout_for, get
from quantkit.model_files import check_folder_links, safetensors_files
from quantkit.qtensor import QuantizedWeight
from quantkit.scheme_presets import QuantArgs, SchemePreset

CT_VERSION = "0.20.1"  # the compressed-tensors release whose config schema this follows
WRITABLE = ("FP8", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "MXFP4XFP8", "MXFP8A16", "MXFP8",
            "W4AFP8")
DEFAULT_IGNORE = (r"(^|\.)lm_head$",)


def layout_of(preset: SchemePreset) -> str:
    """The compressed-tensors format that stores this preset's weights."""
    if preset.name not in WRITABLE:
        raise QuantkitError(f"--scheme {preset.name} is not written by quantkit.float_checkpoint (an integer "
                            f"scheme goes through the integer path); choose one of {', '.join(WRITABLE)}")
    if preset.weights.kind == "int":  # W4AFP8: integer weights pack-quantized, FP8 inputs
        ok, reason = get("compressed-tensors").can_store(preset)
        if not ok:
            raise QuantkitError(f"--scheme {preset.name}: {reason}")
        return compressed_tensors.FORMAT
    layout = float_layout_for(preset)
    if layout is None:
        raise QuantkitError(f"--scheme {preset.name}: {get('compressed-tensors').can_store(preset)[1]}")
    return layout


def quantize_weight(weight: torch.Tensor, preset: SchemePreset, global_scale: torch.Tensor | None = None,
                    search: Optional[bool] = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(tensors to store, the float32 weight they dequantize to) for one linear's weight; `global_scale`
    (NVFP4 only) overrides the weight's own, for linears a runtime fuses (`shared_global_scales`); `search`:
    the range search of the scales (`float_codecs.scale_search`; None: the format's default)."""
    layout = layout_of(preset)
    w = preset.weights
    search = scale_search.enabled(w, search)
    if layout == ct_float_quantized.FORMAT:
        q = fp8.quantize(weight, w.strategy, w.block_size, search=search)
        return ct_float_quantized.pack(q), q.dequantize()
    if layout == ct_nvfp4.FORMAT:
        q = nvfp4.quantize(weight, gscale=global_scale, search=search)
        return ct_nvfp4.pack(q), q.dequantize()
    if layout == ct_mxfp8.FORMAT:
        q = mxfp8.quantize(weight, search=search)
        return ct_mxfp8.pack(q), q.dequantize()
    q = mxfp4.quantize(weight, search=search)
    return ct_mxfp4.pack(q), q.dequantize()


def _args_config(a: QuantArgs, observer: Optional[str] = None) -> dict:
    """QuantArgs in compressed-tensors' QuantizationArgs schema (config.json)."""
    return {
        "num_bits": a.bits, "type": a.kind, "symmetric": a.symmetric, "group_size": a.group_size,
        "strategy": a.strategy, "block_structure": list(a.block_size) if a.block_size else None,
        "dynamic": a.dynamic, "actorder": None, "observer": observer,
        "scale_dtype": f"torch.{a.scale_dtype}" if a.scale_dtype else None,
        "zp_dtype": f"torch.{a.scale_dtype}" if a.scale_dtype else None,
    }


def quantization_config(preset: SchemePreset, ignore: Iterable[str]) -> dict:
    """config.json "quantization_config": one group targeting every Linear, `ignore` exact module names."""
    layout = layout_of(preset)
    acts = preset.input_activations
    # static (calibrated) activations name compressed-tensors' preset observer: a running min/max over all batches
    group = {"targets": ["Linear"], "weights": _args_config(preset.weights),
             "input_activations": _args_config(acts, "static_minmax" if preset.calibrates_activations else None)
             if acts else None,
             "output_activations": None, "format": layout}
    return {"quant_method": "compressed-tensors", "format": layout, "quantization_status": "compressed",
            "version": CT_VERSION, "config_groups": {"group_0": group}, "ignore": sorted(ignore),
            "kv_cache_scheme": None, "global_compression_ratio": None, "sparsity_config": {},
            "transform_config": {}}


@contextlib.contextmanager
def _experts_as_linears(model: torch.nn.Module):
    """For the duration: every fused experts module of a transformers MoE model swapped for per-expert
    `nn.Linear`s viewing the same weights (`models.experts.RoutedExperts`), named as checkpoints name them
    (``mlp.experts.{e}.gate_proj``). Yields the family's adapter, None for an architecture without one."""
    from quantkit.models import get_adapter
    from quantkit.models.experts import RoutedExperts

    try:
        adapter = get_adapter(model)
    except QuantkitError:
        yield None
        return
    swapped = []
    try:
        for layer in adapter.decoder_layers(model):
            for block in adapter.moe_blocks(layer):
                parent_name, _, child = block.experts.rpartition(".")
                parent = layer.get_submodule(parent_name) if parent_name else layer
                fused = getattr(parent, child)
                setattr(parent, child, RoutedExperts.from_fused(fused))
                swapped.append((parent, child, fused))
        yield adapter
    finally:
        for parent, child, fused in swapped:
            setattr(parent, child, fused)


# a pass before the rounding or GPTQ (`quantizers.float_passes`): SmoothQuant, AWQ's scale search; after GPTQ,
# SignRound's signed-gradient rounding of each layer against its unquantized output (`quantizers.signround`)
METHODS = ("rtn", "gptq", "gptq+signround", "smoothquant", "smoothquant+gptq", "smoothquant+gptq+signround", "awq",
           "awq+gptq", "awq+gptq+signround")
# the method (and its options) a preset gets when the run names none: round-to-nearest, except where SmoothQuant
# with the alpha search was measured lower KL on both held-out texts with RTN and with GPTQ (the FP4-activation
# presets: docs/float-schemes.md, 27-35 % lower on the demo); an explicit --method rtn / gptq stays plain
DEFAULT_METHODS = {"NVFP4": ("smoothquant", {"alpha": "auto"}), "MXFP4": ("smoothquant", {"alpha": "auto"})}


def write(model: torch.nn.Module, preset: SchemePreset, output: os.PathLike,
          ignore: Iterable[str] = DEFAULT_IGNORE, method: str = "rtn", calibration: Optional[torch.Tensor] = None,
          options: Optional[dict] = None, batch_size: int = 8, progress: bool = False,
          kv_scales=None, save_dtype: Optional[torch.dtype] = None, max_shard_size="5GB",
          device: torch.device | str = "cpu", store=None, layer_source=None, comm=None,
          stats: Optional[dict] = None) -> Optional[dict[str, tuple]]:
    """Quantize every nn.Linear of a transformers model not matching `ignore` (regexes) and save it to `output`
    (a new folder; written in a staging folder beside it and renamed, so a failure leaves nothing behind).
    MoE experts are quantized one linear per expert and projection (the names compressed-tensors and vLLM
    read); routers and shared-expert gates stay in full precision, declared in the config's ignore list.
    `method` "rtn" rounds each weight to nearest; "gptq" runs GPTQ on the preset's grid
    (`quantizers.gptq_float`) through quantkit's layer-by-layer pipeline, calibrated on `calibration` (token
    ids [samples, seq_len]) with `options` (damp_percent, block_size, desc_act, true_sequential; and mse, the
    scales' range search, for both methods: `float_codecs.scale_search`, None its format's default); it leaves
    `model`'s linears fake-quantized, as the pipeline does. "smoothquant" / "smoothquant+gptq" first smooth
    `model` in place for a preset with quantized activations (`quantizers.smoothquant_float`, options alpha,
    alpha_step, search_tokens, smooth), "awq" / "awq+gptq" first run AWQ's scale search on the preset's grid
    (`quantizers.awq_float`), then round or run GPTQ as above; static input scales are measured on the
    transformed model. `kv_scales` (quantkit.kv_calibration.KVScales)
    adds the calibrated FP8 KV-cache scales and the config's kv_cache_scheme. The tensors left unquantized
    (embeddings, norms, biases, ignored linears) are written in `save_dtype` (None: as `model` holds them), the
    files sharded at `max_shard_size` as `save_pretrained` shards them; the calibration passes run each layer on
    `device`. With a started `store` (quantkit.progress.ProgressStore) the calibration passes save each
    finished layer there (a transform pass in its child store "pass") and restore those already saved, so an
    interrupted run resumed with the same store writes the same bytes; the checkpoint of a run whose pipeline kept
    a store is assembled from it one layer at a time (`_tensors_from_store`). With a `layer_source`
    (quantkit.streaming: `model` is a skeleton whose decoder layers are read from its files one at a time) and a
    started `store`, every layer goes through the pipeline (round-to-nearest as its step
    `quantizers.rtn_float.FloatRTN`), so memory holds one layer, not the model; the same bytes as in memory. With a
    `comm` of several data-parallel ranks (quantkit.pipeline.distributed; `store` then the run's
    `ReplicatedStore`), GPTQ's calibration is shared among them as on the integer path and rank 0 alone writes,
    the same bytes as one process. A dict as `stats` receives the pipeline's per-layer stats (a refiner's reports
    among them: `Recipe.refinement_report`; a resumed run's restored layers included). Returns {module name:
    weight shape} of the quantized linears (what they dequantize to: `read_dequantized(output)`); None on the
    ranks that do not write."""
    out = Path(output)
    if out.exists():
        raise QuantkitError(f"output folder {out} already exists; choose a new folder")
    layout_of(preset)
    if method not in METHODS:
        raise QuantkitError(f"--scheme {preset.name} is written with --method {', '.join(METHODS)}, not {method!r}")
    from quantkit.quantizers import float_passes

    integer = preset.weights.kind == "int"  # W4AFP8: the integer steps, with their own options
    first, method = float_passes.parse_method(method, preset)
    pass_options, options = first.split(options or {}) if first is not None else ({}, dict(options or {}))
    if method == "rtn" and calibration is not None and not preset.calibrates_activations and first is None:
        raise QuantkitError(f"round-to-nearest onto --scheme {preset.name} reads no calibration data; drop it or use "
                            "--method gptq")
    if method == "rtn" and not integer and set(options) - {"mse"}:
        raise QuantkitError("round-to-nearest onto a float grid takes no option but mse; drop them or use "
                            "--method gptq")
    if preset.calibrates_activations and calibration is None:
        raise QuantkitError(f"--scheme {preset.name} stores input scales measured on calibration data; it needs "
                            "calibration token ids with --method rtn as with gptq")
    if layer_source is not None:
        _check_streamable(preset, first, method, store)
    if comm is not None and comm.world > 1:
        _check_data_parallel(model, preset, first, method)
    check_shapes(model, preset, tuple(ignore))
    if first is not None:  # exact in full precision: everything below sees the transformed model
        float_passes.run_pass(model, preset, first, pipeline_linears(model, tuple(ignore))[1], calibration,
                              pass_options, batch_size, progress, device,
                              store=store.child("pass") if store is not None else None)
    # static input scales: with float GPTQ, from the inputs its pipeline observes (each linear's, with everything
    # before it already quantized, as in the checkpoint); otherwise from a forward of the model as given
    scales_from_gptq = preset.calibrates_activations and method.startswith("gptq") and not integer
    input_scales = _input_scales(model, preset, tuple(ignore), calibration, batch_size) \
        if preset.calibrates_activations and not scales_from_gptq else {}
    if integer:
        results = _integer_results(model, preset, tuple(ignore), method, calibration, options, batch_size,
                                   progress, device, store, layer_source, comm, stats)
    elif method in ("gptq", "gptq+signround"):
        if first is not None:  # after a pass, GPTQ calibrates on the unrounded inputs unless asked (measured:
            options = {"input_rounding": False, **options}  # SmoothQuant + GPTQ on NVFP4 gains nothing from it)
        results = _gptq_results(model, preset, tuple(ignore), calibration, options, batch_size, progress,
                                record_input_absmax=scales_from_gptq, device=device, store=store,
                                refine=method == "gptq+signround", layer_source=layer_source, comm=comm,
                                stats=stats)
    elif layer_source is not None:  # streamed round-to-nearest: as a pipeline step, layer by layer
        results = _rtn_results(model, preset, tuple(ignore), options, progress, device, store, layer_source)
    else:
        results = None
    if comm is not None and comm.rank != 0:
        return None  # rank 0 writes
    from quantkit.pipeline.distributed import staging_store

    store = staging_store(store)  # rank 0's own store, read without collectives
    # the static input scales from the absmax GPTQ's results carry (read where the results are read)
    scales_of = (lambda absmax: _input_scales(model, preset, tuple(ignore), absmax=absmax)) if scales_from_gptq \
        else None
    with contextlib.ExitStack() as scratch:
        if store is not None and (layer_source is not None or integer or method in ("gptq", "gptq+signround")):
            # the pipeline kept every layer's results in the store: assembled from there one layer at a time
            layout, load, written, kept, rename = scratch.enter_context(
                _tensors_from_store(out, model, preset, tuple(ignore), store, scales_of, save_dtype))
        else:
            if scales_of is not None:
                input_scales = scales_of({n: r.input_absmax for n, r in results.items() if r.input_absmax is not None})
            layout, load, written, kept, rename = _in_memory_tensors(model, preset, tuple(ignore), results,
                                                                     options.get("mse"), input_scales, save_dtype)
        if not written:
            raise QuantkitError("no linear layers left to quantize after the ignore list; loosen --ignore")
        config = model.config.to_dict()
        config["quantization_config"] = quantization_config(preset, sorted({rename(n) for n in kept}))
        if kv_scales is not None:
            extra = kv_scales.tensors(rename)
            layout.update({k: (t.dtype, tuple(t.shape)) for k, t in extra.items()})
            load = (lambda own: lambda k: extra[k] if k in extra else own(k))(load)
            config["quantization_config"]["kv_cache_scheme"] = kv_scales.scheme.config()
        if save_dtype is not None:
            config["dtype"] = str(save_dtype).replace("torch.", "")  # as the integer checkpoints (checkpoint._save_config)
            config.pop("torch_dtype", None)
        _save(out, layout, load, config, max_shard_size)
    return written


def _in_memory_tensors(model: torch.nn.Module, preset: SchemePreset, patterns: tuple[str, ...],
                       results: Optional[dict], search: Optional[bool], input_scales: dict,
                       save_dtype: Optional[torch.dtype]):
    """(layout {checkpoint tensor name: (dtype, shape)}, load(name), {module name: weight shape}, the linears
    left in full precision, rename) of a model held in memory (`_quantized_state`, experts as their linears)."""
    with _experts_as_linears(model) as adapter:
        rename = adapter.checkpoint_name if adapter is not None else (lambda n: n)
        full_precision = set(adapter.full_precision_modules(model)) if adapter is not None else set()
        state, shapes, skipped = _quantized_state(model, preset, patterns, full_precision, results,
                                                  search=search, input_scales=input_scales, save_dtype=save_dtype)
    state = {rename(k): v for k, v in state.items()}
    return ({k: (t.dtype, tuple(t.shape)) for k, t in state.items()}, state.__getitem__, shapes,
            skipped | full_precision, rename)


def _quantized_names(model: torch.nn.Module, patterns: tuple[str, ...], full_precision: set[str]) -> list[str]:
    """The nn.Linear modules this writer quantizes: all but the full-precision ones and those `ignore` matches."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and n not in full_precision and not any(re.search(p, n) for p in patterns)]


def check_shapes(model: torch.nn.Module, preset: SchemePreset, patterns: tuple[str, ...]) -> None:
    """Refuse, before any work, a preset some quantized linear cannot take: weight groups that do not divide
    its input size (the layout's own declaration), or input activations quantized in groups that do not (no
    runtime can run that checkpoint: compressed-tensors' forward and vLLM split each input row into whole
    groups, as quantkit's loader does)."""
    acts = preset.input_activations
    act_group = acts.group_size if acts is not None and acts.strategy == "group" else None
    layout = LAYOUTS[layout_of(preset)] if preset.weights.kind == "float" else None  # W4AFP8: its integer plan checks
    with _experts_as_linears(model) as adapter:
        full_precision = set(adapter.full_precision_modules(model)) if adapter is not None else set()
        for name in _quantized_names(model, patterns, full_precision):
            module = model.get_submodule(name)
            if layout is not None:
                layout.packed_shapes((module.out_features, module.in_features), preset.weights)
            if act_group and module.in_features % act_group:
                raise QuantkitError(
                    f"--scheme {preset.name} quantizes each linear's inputs in groups of {act_group}; {name}'s input "
                    f"size {module.in_features} is not a multiple of {act_group}, so no runtime could run the "
                    "checkpoint; choose a preset with per-token or MX-group (32) activations, or a weight-only one")


def _input_scales(model: torch.nn.Module, preset: SchemePreset, patterns: tuple[str, ...],
                  calibration: Optional[torch.Tensor] = None, batch_size: int = 8,
                  absmax: Optional[dict[str, torch.Tensor]] = None) -> dict[str, tuple[str, torch.Tensor]]:
    """{linear name (experts per linear): (tensor suffix, value)} of the preset's static input scales, from
    each quantized linear's input absmax: `absmax` as observed elsewhere (GPTQ's pipeline; a linear no token
    reached, an MoE expert never routed to, counts 0 as in `input_absmax`), else measured over `calibration`
    with a forward of `model` (NVFP4: fused siblings share their maximum)."""
    from quantkit.activation_absmax import input_absmax
    from quantkit.float_codecs.fused_global_scale import shared_absmax
    from quantkit.float_codecs.input_scales import NVFP4_INPUT_GLOBAL_SCALE, input_scale_for, tensor_name

    acts = preset.input_activations
    with _experts_as_linears(model) as adapter:
        full_precision = set(adapter.full_precision_modules(model)) if adapter is not None else set()
        names = _quantized_names(model, patterns, full_precision)
        if absmax is None:
            absmax = input_absmax(model, names, calibration, batch_size)
        else:
            absmax = {n: absmax.get(n, torch.zeros((), dtype=torch.float32)) for n in names}
        if tensor_name(acts) == NVFP4_INPUT_GLOBAL_SCALE:
            absmax = shared_absmax(model, absmax)
    return {name: input_scale_for(acts, a) for name, a in absmax.items()}


def pipeline_linears(model: torch.nn.Module, patterns: tuple[str, ...]):
    """(the model's adapter, the linears the calibration pipeline quantizes: all but the adapter's full-precision
    ones and those `ignore` matches)."""
    from quantkit.models import get_adapter

    adapter = get_adapter(model)
    full_precision = set(adapter.full_precision_modules(model))
    return adapter, [n for n in adapter.linear_shapes(model)
                     if n not in full_precision and not any(re.search(p, n) for p in patterns)]


def _integer_results(model: torch.nn.Module, preset: SchemePreset, patterns: tuple[str, ...], method: str,
                     calibration: Optional[torch.Tensor], options: dict, batch_size: int, progress: bool,
                     device: torch.device | str = "cpu", store=None, layer_source=None,
                     comm=None, stats: Optional[dict] = None) -> Optional[dict]:
    """{linear name: QuantizedWeight} of the integer recipe `method` (rtn, gptq, awq, awq,gptq: with `options`,
    as on the integer path) on the preset's integer weight grid (W4AFP8: 4-bit symmetric groups of 128), through
    quantkit's pipeline."""
    from quantkit.pipeline import quantize_model
    from quantkit.quantizers.recipe import build_recipe
    from quantkit.scheme import LinearScheme

    recipe = build_recipe(method.replace("+", ","), options)  # "gptq+signround": the integer steps' spelling
    if recipe.needs_calibration and calibration is None:
        raise QuantkitError(f"--scheme {preset.name} with --method {method} needs calibration data (token ids)")
    adapter, names = pipeline_linears(model, patterns)
    w = preset.weights
    shapes = adapter.linear_shapes(model)
    for name in names:  # before any calibration: a group that does not divide a linear's inputs is refused here
        try:
            ct_w4afp8.packed_shapes(shapes[name], w)
        except QuantkitError as exc:
            raise QuantkitError(f"--scheme {preset.name}: {name}: {exc}; leave it in full precision with --ignore") \
                from None
    scheme = LinearScheme(bits=w.bits, group_size=w.group_size if w.strategy == "group" else -1, sym=w.symmetric)
    results = quantize_model(model, adapter, recipe, dict.fromkeys(names, scheme),
                             calibration if recipe.needs_calibration else None, batch_size=batch_size,
                             progress=progress, device=device, store=store, layer_source=layer_source,
                             release_layers=layer_source is not None, comm=comm, stats=stats)
    return _kept_results(results, store, layer_source)


def _gptq_results(model: torch.nn.Module, preset: SchemePreset, patterns: tuple[str, ...],
                  calibration: Optional[torch.Tensor], options: dict, batch_size: int, progress: bool,
                  record_input_absmax: bool = False, device: torch.device | str = "cpu", store=None,
                  refine: bool = False, layer_source=None, comm=None, stats: Optional[dict] = None) -> Optional[dict]:
    """{linear name: FloatResult} of GPTQ on the preset's grid, from quantkit's calibration pipeline (each
    with the absmax of the inputs GPTQ observed, `input_absmax`, when `record_input_absmax`); with `refine`,
    each layer's results then tuned together by SignRound (its options among `options`)."""
    from quantkit.pipeline import quantize_model
    from quantkit.quantizers.gptq_float import FloatGPTQ
    from quantkit.quantizers.recipe import Recipe
    from quantkit.quantizers.signround import SignRoundRefiner
    from quantkit.scheme import LinearScheme

    if calibration is None:
        raise QuantkitError(f"--scheme {preset.name} with --method gptq needs calibration data (token ids)")
    adapter, names = pipeline_linears(model, patterns)
    step = FloatGPTQ(preset.weights, preset.input_activations,
                     **{k: v for k, v in options.items() if k not in SignRoundRefiner.options_spec})
    if record_input_absmax:
        step.record_input_absmax()
    if refine:
        step = Recipe([step, float_signround(options)])
    schemes = dict.fromkeys(names, LinearScheme(bits=preset.weights.bits, group_size=-1, sym=True))
    results = quantize_model(model, adapter, step, schemes, calibration, batch_size=batch_size, progress=progress,
                             device=device, store=store, layer_source=layer_source,
                             release_layers=layer_source is not None, comm=comm, stats=stats)
    return _kept_results(results, store, layer_source)


def _rtn_results(model: torch.nn.Module, preset: SchemePreset, patterns: tuple[str, ...], options: dict,
                 progress: bool, device, store, layer_source) -> None:
    """Round-to-nearest of every layer through the pipeline (a streamed model), each finished layer in `store`."""
    from quantkit.pipeline import quantize_model
    from quantkit.quantizers.rtn_float import FloatRTN
    from quantkit.scheme import LinearScheme

    adapter, names = pipeline_linears(model, patterns)
    schemes = dict.fromkeys(names, LinearScheme(bits=preset.weights.bits, group_size=-1, sym=True))
    quantize_model(model, adapter, FloatRTN(preset, **options), schemes, None, progress=progress, device=device,
                   store=store, layer_source=layer_source, release_layers=True)


def _kept_results(results: dict, store, layer_source) -> Optional[dict]:
    """The pipeline's results as the writer reads them: None where there is a store (the writer then reads each
    layer's from there, a resumed run's restored layers among them: `_results`, `_tensors_from_store`), so no more
    than one layer's results are in memory at once; else the pipeline's own."""
    return results if store is None else None


def _check_data_parallel(model: torch.nn.Module, preset: SchemePreset, first, method: str) -> None:
    """Refuse, with the reason, what data-parallel ranks cannot share (they split GPTQ's calibration samples)."""
    from quantkit.models import get_adapter

    if first is not None:
        raise QuantkitError(f"--nproc shares GPTQ's calibration among the ranks; the --method {first.name} pass runs "
                            "in one process: drop --nproc, or use --method gptq")
    if method == "rtn":
        raise QuantkitError(f"--nproc shares calibration among the ranks; round-to-nearest onto --scheme {preset.name} "
                            "has none to share: drop --nproc, or use --method gptq")
    adapter = get_adapter(model)
    if any(adapter.moe_blocks(layer) for layer in adapter.decoder_layers(model)):  # as the integer path refuses
        raise QuantkitError("data-parallel calibration of Mixture-of-Experts models is not supported yet (each "
                            "expert's routed tokens would need their own reduction); drop --nproc / torchrun")


def _check_streamable(preset: SchemePreset, first, method: str, store) -> None:
    """Refuse, with the reason, what a streamed float run cannot do (the model is read one layer at a time)."""
    if store is None:
        raise ValueError("a streamed float run keeps its layers in a started progress store; pass store=")
    if first is not None:
        is_default = DEFAULT_METHODS.get(preset.name, ("",))[0] == first.name and method == "rtn"
        default = f" (the default for --scheme {preset.name})" if is_default else ""
        raise QuantkitError(f"--streaming reads one layer at a time, and --method {first.name}{default} transforms the "
                            "whole model before it is rounded; use --method rtn or gptq, or drop --streaming")
    if method == "rtn" and preset.calibrates_activations:
        raise QuantkitError(f"--scheme {preset.name} with --method rtn measures its static input scales on a forward "
                            "of the whole model, which --streaming does not hold; use --method gptq (its scales "
                            "come from the layer-by-layer pass) or drop --streaming")



# SignRound's defaults where a float grid's differ from the integer ones' (measured on the demo, NVFP4A16, 32 x 256
# lee calibration; docs/float-schemes.md): the group scales stay GPTQ's (an E4M3 group scale moves in jumps of
# 6-12 % and the signed steps move every group's factor at once: layers 0 and 1 never improved with the factor
# tuned), and each step is the gradient over its RMS, clipped ("scaled": flips the offsets with the largest
# gradients first; KL lee / wiki 0.0689 / 0.1084 against 0.0697 / 0.1118 with plain signs)
FLOAT_SIGNROUND_DEFAULTS = {"scale_range": [1.0, 1.0], "step_rule": "scaled"}


def float_defaults(method: str, preset: SchemePreset) -> dict:
    """The options `method` runs with on `preset`'s float grid where they differ from the integer recipe's
    defaults (what the model card must say beside the options given; W4AFP8's integer steps keep theirs)."""
    return dict(FLOAT_SIGNROUND_DEFAULTS) if method.endswith("signround") and preset.weights.kind == "float" else {}


def float_signround(options: dict):
    """SignRound for a float grid, from the SignRound options among `options` (refusing the starts a float
    quantizer cannot give: plain round-to-nearest's, and the quantizer's rounded weights)."""
    from quantkit.quantizers.signround import SignRoundRefiner

    own = {k: v for k, v in options.items() if k in SignRoundRefiner.options_spec}
    if own.get("start", "quantizer") != "quantizer" or own.get("start_position") == "rounded":
        raise QuantkitError("signround on a float grid starts from GPTQ's solution (start=quantizer) with "
                            "start_position rtn or centre; drop start / start_position=rounded")
    return SignRoundRefiner(**{**FLOAT_SIGNROUND_DEFAULTS, **own})


def _quantized_state(model: torch.nn.Module, preset: SchemePreset, patterns: tuple[str, ...],
                     full_precision: set[str], results: Optional[dict] = None, search: Optional[bool] = None,
                     input_scales: Optional[dict] = None, save_dtype: Optional[torch.dtype] = None
                     ) -> tuple[dict[str, torch.Tensor], dict[str, tuple], set[str]]:
    """(the state dict with every quantized linear's weight replaced by its layout's tensors and its static
    input scale from `input_scales` added, {module: weight shape}, the linears left in full precision).
    With `results` (GPTQ's, or the integer steps'), each linear's weight object comes from there instead of
    round-to-nearest. The model's own floating tensors are cast to `save_dtype` (the quantized ones keep their
    layout's dtypes)."""
    state = {k: v.detach().to(save_dtype) if save_dtype is not None and v.is_floating_point() else v.detach()
             for k, v in model.state_dict().items()}
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    skipped = {n for n in linears if n in full_precision or any(re.search(p, n) for p in patterns)}
    rtn_nvfp4 = results is None and layout_of(preset) == ct_nvfp4.FORMAT
    shared = shared_global_scales(model, set(linears) - skipped) if rtn_nvfp4 else {}
    shapes = {}
    for name, module in linears.items():
        if name in skipped:
            continue
        if results is None:
            tensors, _ = quantize_weight(module.weight.detach(), preset, shared.get(name), search)
        else:
            if name not in results:
                raise QuantkitError(f"GPTQ left {name} unquantized; this is a bug")
            q = results[name] if isinstance(results[name], QuantizedWeight) else results[name].weight
            tensors = LAYOUTS[layout_of(preset)].pack(q)
        if input_scales:
            suffix, scale = input_scales[name]
            tensors = {**tensors, suffix: scale}
        del state[f"{name}.weight"]
        state.update({f"{name}.{suffix}": t for suffix, t in tensors.items()})
        shapes[name] = tuple(module.weight.shape)
    # tied parameters and per-expert views share storage; safetensors refuses that, so store independent copies
    seen = set()
    for key, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen or tensor.numel() != tensor.untyped_storage().nbytes() // tensor.element_size():
            state[key] = tensor.clone()
        seen.add(ptr)
        state[key] = state[key].contiguous()
    return state, shapes, skipped


@contextlib.contextmanager
def _tensors_from_store(out: Path, model: torch.nn.Module, preset: SchemePreset, patterns: tuple[str, ...], store,
                        scales_of, save_dtype: Optional[torch.dtype]):
    """For the duration: (layout {checkpoint tensor name: (dtype, shape)}, load(name), {module name: weight shape},
    the linears left in full precision, rename: module name -> checkpoint name) of a run whose pipeline kept every
    layer in `store` (a streamed `model` is a skeleton holding only its non-layer tensors; a model in memory gives
    those too): each layer's linears packed by the layout's packer, its other tensors cast to `save_dtype` (None:
    the model's dtype), into a scratch file beside `out` one layer at a time (removed afterwards), so no more than
    one layer's results are in memory; `scales_of` (None: the preset stores none) turns the input absmax the
    results carry, gathered in the same pass, into each linear's static input scale. The layout's order is the
    in-memory writer's (`_quantized_state`: the model's tensors with the quantized weights taken out, then each
    quantized linear's packed tensors and its input scale), so the shards are byte-identical to what it would
    write."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    layout = LAYOUTS[layout_of(preset)]
    with _experts_as_linears(model) as adapter:
        rename = adapter.checkpoint_name if adapter is not None else (lambda n: n)
        full_precision = set(adapter.full_precision_modules(model)) if adapter is not None else set()
        prefix = adapter.layers_prefix(model) + "."
        skeleton = {k: (v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()}
        linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    skipped = {n for n in linears if n in full_precision or any(re.search(p, n) for p in patterns)}
    quantized = [n for n in linears if n not in skipped]

    def own_dtype(key: str) -> Optional[torch.dtype]:  # a record's tensor as the model holds it, or save_dtype
        return save_dtype if save_dtype is not None else skeleton[key][0] if key in skeleton else None

    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.layers.", dir=out.parent))
    try:
        where: dict[str, tuple[Path, torch.dtype, tuple]] = {}  # layer tensor -> (its scratch file, dtype, shape)
        packed_names: dict[str, list[str]] = {}
        shapes: dict[str, tuple] = {}
        absmax: dict[str, torch.Tensor] = {}
        for i in store.done_layers():
            record, tensors = store.load_layer(i), {}
            for name, r in record.quantized.items():
                q = r if isinstance(r, QuantizedWeight) else r.weight
                packed = layout.pack(q)
                if getattr(r, "input_absmax", None) is not None:
                    absmax[name] = r.input_absmax
                packed_names[name] = [f"{name}.{k}" for k in packed]
                tensors.update({f"{name}.{k}": t.contiguous() for k, t in packed.items()})
                if r.bias is not None:
                    tensors[f"{name}.bias"] = _cast(r.bias, own_dtype(f"{name}.bias"))
                shapes[name] = tuple(r.shape)
            tensors.update({k: _cast(v, own_dtype(k)) for k, v in record.other.items()})
            path = scratch / f"layer-{i:05d}.safetensors"
            save_file(tensors, str(path))
            where.update({k: (path, t.dtype, tuple(t.shape)) for k, t in tensors.items()})
            del record, tensors
        missing = [n for n in quantized if n not in packed_names]
        if missing:
            raise QuantkitError(f"the streamed run's records lack {missing[0]}; delete the staging folder and rerun")
        held: dict[str, torch.Tensor] = {}  # the input scales (one value per linear), written after the packed tensors
        for name, (suffix, scale) in (scales_of(absmax) if scales_of is not None else {}).items():
            held[f"{name}.{suffix}"] = scale
            packed_names[name].append(f"{name}.{suffix}")
        where.update({k: (None, t.dtype, tuple(t.shape)) for k, t in held.items()})
        weights = {f"{n}.weight" for n in quantized}
        order = [k for k in skeleton if k not in weights] + [k for n in quantized for k in packed_names[n]]
        plan: dict[str, tuple[Optional[Path], torch.dtype, tuple]] = {}
        for k in order:
            if k.startswith(prefix):
                if k not in where:
                    raise QuantkitError(f"the streamed run's records lack {k}; delete the staging folder and rerun")
                plan[k] = where[k]
            else:
                dtype, shape = skeleton[k]
                plan[k] = (None, save_dtype if save_dtype is not None and dtype.is_floating_point else dtype, shape)
        model_state = model.state_dict()
        original = {rename(k): k for k in plan}

        def load(name: str) -> torch.Tensor:
            key = original[name]
            if key in held:
                return held[key]
            path, dtype, _ = plan[key]
            if path is None:
                return _cast(model_state[key], dtype)
            with safe_open(str(path), framework="pt") as f:  # opened per tensor: nothing stays mapped
                return f.get_tensor(key)

        yield {rename(k): v[1:] for k, v in plan.items()}, load, shapes, skipped | full_precision, rename
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _cast(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    t = tensor.detach()
    return (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous().clone()


def _save(out: Path, layout: dict[str, tuple[torch.dtype, tuple]], load, config: dict, max_shard_size="5GB") -> None:
    """The safetensors shards of `layout` ({name: (dtype, shape)}, each tensor fetched by `load(name)`;
    quantkit.checkpoint.write_shards, as the integer checkpoints are written) + config.json, written in a staging
    folder beside `out` and renamed into place."""
    from quantkit.checkpoint import write_shards

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write_shards(layout, load, staging, max_shard_size)
        (staging / "config.json").write_text(json.dumps(config, indent=2, default=str))
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def read_dequantized(folder: os.PathLike) -> dict[str, torch.Tensor]:
    """{module name: float32 weight} of a single-group compressed-tensors float checkpoint in `folder`
    (float-quantized, mxfp8-quantized, nvfp4-pack-quantized, mxfp4-pack-quantized, or W4AFP8's pack-quantized), reading only
    the safetensors files its index or `model.safetensors` names, each checked to stay inside the folder
    (quantkit.model_files; no pickle)."""
    from safetensors.torch import load_file

    root = Path(folder)
    try:
        check_folder_links(root)  # a linked config or weights file must not lead outside the folder
        qcfg = json.loads((root / "config.json").read_text())["quantization_config"]
    except (OSError, ValueError, KeyError) as exc:
        raise QuantkitError(f"{root} has no readable config.json with a quantization_config ({exc})") from None
    groups = list((qcfg.get("config_groups") or {}).values())
    if qcfg.get("quant_method") != "compressed-tensors" or len(groups) != 1:
        raise QuantkitError("only single-group compressed-tensors float checkpoints are read yet")
    layout = LAYOUTS.get(groups[0].get("format") or qcfg.get("format"))
    if layout is None:
        raise QuantkitError(f"format {qcfg.get('format')!r} is not a compressed-tensors float layout; "
                            f"expected one of {', '.join(LAYOUTS)}")
    weights = args_from_config(groups[0].get("weights") or {})
    ok, reason = layout.can_store(weights)
    if not ok:
        raise QuantkitError(f"quantization_config disagrees with itself: {reason}")
    tensors = {}
    for path in safetensors_files(root):
        try:
            tensors.update(load_file(str(path)))
        except Exception as exc:  # safetensors raises its own error type for a damaged file
            raise QuantkitError(f"cannot read {path.name}: {str(exc).splitlines()[0] if str(exc) else exc!r}; "
                                "the file is damaged, re-download or re-export it") from None
    unpacked = layout in (ct_float_quantized, ct_mxfp8)  # FP8 elements stored as they are, one per byte
    marker = "weight_scale" if unpacked else "weight_packed"
    modules = sorted(k[: -len(marker) - 1] for k in tensors if k.endswith("." + marker))
    out = {}
    for name in modules:
        own = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        if unpacked:
            if "weight" not in own:
                raise QuantkitError(f"{name} has a weight_scale but no weight; the checkpoint is incomplete")
            q = layout.read(own, tuple(own["weight"].shape), weights)
        elif layout is ct_w4afp8:
            if "weight_shape" not in own:
                raise QuantkitError(f"{name} has a weight_packed but no weight_shape; the checkpoint is incomplete")
            q = layout.read(own, tuple(int(v) for v in own["weight_shape"].tolist()), weights)
        else:
            packed = own["weight_packed"]
            q = layout.unpack(own, (packed.shape[0], packed.shape[1] * 2))
        out[name] = q.dequantize()
    if not out:
        raise QuantkitError(f"{root} holds no {layout.FORMAT} tensors; the checkpoint does not match its config")
    return out
