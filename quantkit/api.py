"""The Python surface: `quantize`, `load`, `evaluate`. The CLI is a thin shell over these."""
from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from quantkit import __version__
from quantkit.errors import QuantkitError
from quantkit.memory import peak_rss_mb
from quantkit.quantizers.base import Step


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    return {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


@dataclass(frozen=True)
class QuantizeResult(Mapping):
    """What `quantize` did: the checkpoint folder, the plan it ran (with the calibration tokens' shape,
    source and SHA-256), the measured quality when `eval_after=True` (else None), and the JSON summary
    `quantize --json` prints. Reading it as a mapping reads the summary (`result["seconds"]`)."""

    output: Path
    plan: Any  # quantkit.plan.QuantizePlan
    metrics: Optional[dict[str, Any]]
    summary: dict[str, Any]
    resolved: Any = None  # quantkit.run_recipe.ResolvedRun: what the checkpoint's recipe.yaml records

    def __getitem__(self, key: str) -> Any:
        return self.summary[key]

    def __iter__(self):
        return iter(self.summary)

    def __len__(self) -> int:
        return len(self.summary)


def quantize(
    model: Union[str, Path, nn.Module, None] = None,
    method: Union[str, list, Step, None] = None,
    *,
    tokenizer: Any = None,
    scheme: Optional[str] = None,
    bits: Optional[int] = None,
    group_size: Union[int, str, None] = None,
    sym: Optional[bool] = None,
    format: Optional[str] = None,
    dataset: Any = None,
    num_samples: Optional[int] = None,
    seq_len: Optional[int] = None,
    seed: Optional[int] = None,
    output: Union[str, Path, None] = None,
    recipe: Union[str, Path, None] = None,
    ignore: Optional[list[str]] = None,
    options: Optional[dict[str, Any]] = None,
    overwrite: bool = False,
    dtype: Optional[str] = None,
    device: Optional[str] = None,
    trust_remote_code: bool = False,
    max_shard_size: Union[str, int, None] = None,
    chat_template: bool = False,
    batch_size: Optional[int] = None,
    eval_after: bool = False,
    progress: bool = True,
    resume: bool = False,
    streaming: Optional[bool] = None,
    gguf_type: Optional[str] = None,
    kv_cache_scheme: Optional[str] = None,
    moe_calibration: Optional[str] = None,
    moe_min_tokens: Optional[int] = None,
    nproc: Optional[int] = None,
    dist_timeout: Optional[float] = None,
    device_map: Optional[str] = None,
    max_memory: Union[str, dict, None] = None,
    target_bits: Optional[float] = None,
    target_size: Optional[str] = None,
    sensitivity: Union[str, Path, None] = None,
) -> Optional[QuantizeResult]:
    """Quantize `model` with `method` and write a packed checkpoint; returns a `QuantizeResult`.

    The keywords are quantkit.run_config.SETTINGS (the CLI's `quantize` options, same names and
    defaults; `quantize --help` groups them). Every checkpoint gets a `recipe.yaml`, the plan as
    resolved on the model: `quantize(recipe="<ckpt>/recipe.yaml", output=...)` writes the same bytes
    (its source model, dtype and shard size are used where not given; calibration on in-memory
    data needs the same tokens passed again as `dataset`, other tokens are refused).
    `scheme` names a compressed-tensors preset (W4A16, W8A16, W8A8, FP8, FP8_DYNAMIC, FP8_BLOCK,
    NVFP4A16, NVFP4, MXFP4A16, MXFP4, MXFP4XFP8, MXFP8A16, MXFP8, W4AFP8; case-insensitive) instead of bits/group_size/sym. `kv_cache_scheme` "fp8"
    (one scale per layer) or "fp8-head" (one per KV head) calibrates static FP8 KV-cache scales on the
    calibration tokens and writes them as compressed-tensors' kv_cache_scheme (quantkit.kv_calibration).

    `model` is a folder, a .gguf file, a hub id, "demo", or an in-memory transformers model, which
    is left untouched: quantkit calibrates a CPU copy (one more copy of the weights in memory; pass
    the folder to avoid it). Its tokenizer is `tokenizer`, else the one in `model.name_or_path`
    when that is a local folder; `tokenizer` also overrides a folder's own. `dataset` is anything
    quantkit.calibration_sources accepts: a name or file, a list of strings or chat conversations,
    a datasets.Dataset, token tensors, {"input_ids"} batches, a DataLoader or iterable of them.
    Token rows of one length are used as given unless `num_samples`/`seq_len` ask for another
    shape; ragged rows are packed into windows. The same tokens give the same bytes whatever
    container carried them; the model card records their SHA-256.

    `method` is a step name (`gptq`), several (`awq,gptq` or a list: transforms, then one weight
    quantizer), or a `Step` instance; `recipe` a YAML recipe (path or bundled name) that the other
    arguments override. Arguments a method does not use are refused, not ignored (e.g. `dataset`
    for RTN). With format="gguf" the weights are quantized onto the blocks of `gguf_type` (a
    llama.cpp type or mix, default the one matching bits/sym) and written as `<output>/model.gguf`.
    Progress is kept per layer in the output's hidden staging folder: after a crash, the
    same call with `resume=True` continues from the last finished layer and writes identical bytes.
    `streaming=None` reads decoder layers from disk one at a time when the model would not fit
    comfortably in memory (True/False force it). Mixture-of-Experts models are calibrated per expert:
    `moe_calibration` "routed" (each expert on the tokens routed to it; one that got fewer than
    `moe_min_tokens` is quantized without calibration) or "all" (every token through every expert).

    `nproc=N` (2, 4 or 8) calibrates data-parallel on N local processes, each on its share of the
    calibration samples (gloo on CPU; with device="cuda" each rank on its own GPU, NCCL); under
    torchrun the launched group is used instead. Any rank count writes the same bytes. Rank 0 writes
    the output and returns the summary; other ranks of a torchrun group return None. A rank that
    fails or hangs ends the run within `dist_timeout` seconds (default 600).

    `device_map="auto"` places the decoder layers with accelerate's device map (GPUs, then host
    memory, then disk, within `max_memory`: {0: "70GiB", "cpu": "200GiB"} or "0=70GiB,cpu=200GiB");
    each layer is calibrated on the GPU that holds it, and layers left on disk are streamed.

    `target_bits` (average bits per weight of the quantized linears, scales, zero points and g_idx
    counted) or `target_size` (of the written files, e.g. "2.1GB") picks a scheme per linear by least
    predicted KL under that budget, from the `sensitivity` report (a `quantkit sensitivity` folder or
    JSON; measured first when not given); see docs/allocation.md."""
    args = _settled_args(dict(locals()))
    from quantkit.disk_errors import writing_output
    from quantkit.models import get_adapter
    from quantkit.sources import in_memory_identity, parse_dtype, source_dtype
    from quantkit.streaming import bounded_heap

    t0 = time.perf_counter()
    model, dtype = args["model"], args["dtype"]
    shard_bytes = _checked_before_work(device, args["max_shard_size"], dist_timeout, target_bits, target_size)
    if max_memory is not None and device_map is None:
        raise QuantkitError("--max-memory budgets --device-map's placement and is read by nothing else; add "
                            "--device-map auto or drop --max-memory")
    in_memory = isinstance(model, nn.Module)
    if in_memory and (nproc not in (None, 1) or _launched()):
        raise QuantkitError("data-parallel ranks each load the model themselves; pass its folder instead of the "
                            "in-memory model, or drop nproc")
    source_ref = _in_memory_folder(model) if in_memory else model  # the folder the output must not replace
    comm = _join_run(args)
    if comm is _SPAWNED:
        return _run_spawned_ranks(args)
    lead = comm is None or comm.rank == 0
    plan = _plan_of(args)
    _check_share(plan, comm)
    if output is not None:
        _on_rank0(comm, lambda: _check_output(Path(output), overwrite, resume, source_ref))
    # held in its storage dtype (bf16 halves the resident model); each decoder layer is cast to fp32
    # only while it is calibrated (exact), and capture_layer_inputs runs the embeddings in fp32
    if device_map is not None and comm is not None:
        raise QuantkitError("--device-map and data-parallel ranks do not combine yet: each rank calibrates on one "
                            "device; drop one of them")
    hf_model, tokenizer, base_name, layer_source = _source_model(model, tokenizer, trust_remote_code, streaming,
                                                                 device_map, max_memory)
    if plan.float_preset is not None:
        return _quantize_float(args, plan, hf_model, tokenizer, base_name, layer_source, comm, source_ref, t0,
                               shard_bytes)
    save_dtype = parse_dtype(dtype) or source_dtype(hf_model.config)
    adapter = get_adapter(hf_model)
    experts = _expert_policy(plan, adapter, hf_model, layer_source, comm)
    schemes = _linear_schemes(plan, hf_model, adapter)
    allocated = _allocation(args, plan, schemes, layer_source, comm, hf_model, save_dtype)  # None: no size budget
    if allocated is not None:
        plan, report, allocation = allocated
        schemes = _linear_schemes(plan, hf_model, adapter)
    if plan.replay is not None:
        plan.replay.check_linears(schemes, model)
    serving = vllm_moe_serving(plan, adapter, hf_model, schemes) if experts is not None else None
    if output is None:
        output = _default_output(base_name, plan, schemes)
        _on_rank0(comm, lambda: _check_output(output, overwrite, resume, source_ref))
    output = Path(output)
    plan, input_ids, cal_batch = _calibration_set(plan, hf_model, tokenizer, comm)
    kv_scales = _integer_kv_scales(plan, hf_model, input_ids, cal_batch, layer_source, comm, progress)
    resolved = _resolved_run(args, plan, schemes, cal_batch, experts, save_dtype,
                             allocation if allocated is not None else None)
    # the model bound now: the size is asked only inside the block, and `hf_model` is deleted after it
    with writing_output(output, lambda m=hf_model: rough_checkpoint_bytes(m, schemes, save_dtype), resume_hint=True):
        store = _progress_store(output, in_memory_identity(hf_model) if in_memory else model, plan, save_dtype,
                                cal_batch, input_ids, resume, comm)
        # what the pipeline runs comes from the resolved run (recipe.yaml says what ran); the rest is run-time
        job = dict(device=_compute_device(device, comm), batch_size=resolved.batch_size or 1,
                   progress=progress and lead, store=store, layer_source=layer_source,
                   experts=resolved.expert_policy, stats={}, comm=comm)
        if serving is not None:
            job["serving"] = serving
        with bounded_heap() if layer_source is not None else contextlib.nullcontext():  # scoped to this run
            reports = _calibrate_and_write(hf_model, adapter, plan, schemes, input_ids, job, output, tokenizer,
                                           base_name, save_dtype, shard_bytes, overwrite, resolved.to_yaml(), kv_scales)
    if comm is not None:
        from quantkit.pipeline.distributed import leave_group

        leave_group()
    if not lead:
        return None
    del hf_model  # --eval loads the written checkpoint instead
    extra = {**(reports or {}),
             **({"ranks": comm.world, "collective_bytes": dict(comm.traffic)} if comm is not None else {}),
             **({"placement": layer_source.placement()} if device_map is not None else {})}
    summarize = lambda metrics: _summary(output, plan, schemes, layer_source, cal_batch, t0, metrics)  # noqa: E731
    return _finished(args, output, plan, resolved, summarize, extra, allocated[1:] if allocated is not None else None)


def _finished(args: dict, output: Path, plan, resolved, summarize, extra: dict, allocated):
    """The result of a written run: scored with --eval (figures into the card), an allocation's report
    beside the checkpoint; `summarize(metrics)` gives the summary (its time taken once all is done)."""
    metrics = None
    if args["eval_after"]:
        model = args["model"]
        metrics = _record_quality(output, None if isinstance(model, nn.Module) else model, plan, args["device"])
    summary = {**summarize(metrics), **extra}
    if allocated is not None:
        from quantkit.allocation.run import record_allocation

        report, allocation = allocated
        record_allocation(output, report, allocation)
        summary["allocation"] = {k: v for k, v in allocation.items() if k != "choice"}
    return QuantizeResult(output=output, plan=plan, metrics=metrics, summary=summary, resolved=resolved)


def _settled_args(args: dict) -> dict:
    """The call's keywords checked against their settings (quantkit.run_config), a Path model as a string,
    and the source model, dtype and shard size a recipe.yaml recorded where the caller gave none."""
    from quantkit.plan import recipe_run_defaults
    from quantkit.run_config import check_values

    check_values(args)
    recorded = recipe_run_defaults(args["recipe"])
    for key, default in (("model", "demo"), ("dtype", None), ("max_shard_size", "5GB")):
        if args[key] is None:
            args[key] = recorded.get(key, default)
    if isinstance(args["model"], Path):
        args["model"] = str(args["model"])
    return args


def _resolved_run(args: dict, plan, schemes: dict, cal_batch, experts, save_dtype, allocation):
    """The run as resolved on its model (quantkit.run_recipe): what recipe.yaml records."""
    from types import MappingProxyType

    from quantkit.run_recipe import ResolvedRun

    model = args["model"]
    return ResolvedRun(plan=plan, linears=MappingProxyType(dict(schemes)), batch_size=cal_batch, expert_policy=experts,
                       dtype=str(save_dtype).replace("torch.", ""), max_shard_size=str(args["max_shard_size"]),
                       source_model=None if isinstance(model, nn.Module) else str(model),
                       allocation={k: v for k, v in allocation.items() if k != "choice"} if allocation else None)


def _quantize_float(args: dict, plan, hf_model, tokenizer, base_name: str, layer_source, comm, source_ref, t0,
                    shard_bytes: int):
    """A float preset (--scheme NVFP4A16, FP8_DYNAMIC, ...): round-to-nearest or GPTQ onto its grid, written
    as a compressed-tensors folder by quantkit.float_checkpoint, with the tokenizer and recipe.yaml, staged
    and renamed into place; --dtype (the unquantized tensors' dtype, the source's by default), --max-shard-size
    and --device as for the integer schemes."""
    from quantkit import float_checkpoint
    from quantkit.checkpoint import replace_dir, staging_dir
    from quantkit.disk_errors import writing_output
    from quantkit.float_card import float_model_card
    from quantkit.run_recipe import RECIPE_FILE, non_default_options

    p = plan.float_preset
    if args["target_bits"] is not None or args["target_size"]:
        raise QuantkitError(f"--scheme {p.name} writes one scheme for every linear; drop --target-bits/--target-size")
    if (layer_source is not None or comm is not None) and plan.kv_cache is not None:
        raise QuantkitError("--kv-cache-scheme observes the whole model's keys and values in one process, which "
                            "--streaming / --device-map / --nproc do not give; drop one of them")
    from quantkit.pipeline.distributed import leave_group, staging_store
    from quantkit.sources import in_memory_identity, parse_dtype, source_dtype
    from quantkit.streaming import bounded_heap

    lead = comm is None or comm.rank == 0  # data-parallel: rank 0 alone touches the output

    save_dtype = parse_dtype(args["dtype"]) or source_dtype(hf_model.config)
    output = Path(args["output"]) if args["output"] is not None else \
        Path(f"{Path(base_name).name.lower()}-{plan.recipe.name}-{p.name.lower()}")
    _on_rank0(comm, lambda: _check_output(output, args["overwrite"], args["resume"], source_ref))
    stage = staging_dir(output).with_name(f".{output.name}.float-partial")  # the checkpoint while it is written
    # a full disk or unwritable place: one line (the finished layers kept for --resume where there are any)
    with writing_output(output, resume_hint=plan.recipe.needs_calibration or layer_source is not None):
        if lead:
            shutil.rmtree(stage, ignore_errors=True)
            stage.mkdir(parents=True)
        ids = batch = store = None
        stats: dict = {}  # the pipeline's per-layer stats: SignRound's reports for the card
        try:
            folder = stage / "checkpoint"
            if plan.calibration is not None:  # GPTQ, and FP8 / NVFP4's static input scales with either method
                plan, ids, batch = _calibration_set(plan, hf_model, tokenizer, comm)
            kv_scales = _kv_cache_scales(plan, hf_model, ids, batch, args["progress"])  # before GPTQ changes it
            if kv_scales is not None and not plan.recipe.needs_calibration and not p.calibrates_activations:
                ids = None  # drawn for the KV-cache scales only
            # the calibration passes' finished layers, kept for --resume where the integer runs keep theirs
            source = in_memory_identity(hf_model) if isinstance(args["model"], nn.Module) else args["model"]
            store = _progress_store(output, source, plan, save_dtype, batch, ids, args["resume"], comm,
                                    layout=f"compressed-tensors:{float_checkpoint.layout_of(p)}")
            with bounded_heap() if layer_source is not None else contextlib.nullcontext():  # as the integer runs
                shapes = float_checkpoint.write(  # {module name: weight shape}
                    hf_model, p, folder, ignore=plan.scheme.ignore, method=plan.recipe.name, calibration=ids,
                    options=non_default_options(plan.recipe), batch_size=batch or 8,
                    progress=bool(args["progress"]) and lead, kv_scales=kv_scales, save_dtype=save_dtype,
                    max_shard_size=shard_bytes, device=_compute_device(args["device"], comm), store=store,
                    layer_source=layer_source, comm=comm, stats=stats)
            if not lead:  # rank 0 writes and returns the summary
                leave_group()
                return None
            store = staging_store(store)
            if tokenizer is not None:
                tokenizer.save_pretrained(folder)
            qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
            used = {k: v for k, v in plan.method_info().items() if k not in plan.recipe.describe() or k == "method"}
            # the options the writer took (not the defaults), with those a float grid sets for its refiner
            card_method = {**used, **float_checkpoint.float_defaults(plan.recipe.name, p),
                           **non_default_options(plan.recipe)}
            refinement = plan.recipe.refinement_report(stats)  # (summary, card section) or None, as for integer runs
            (folder / "README.md").write_text(float_model_card(base_name, p, card_method, qcfg, shapes)
                                              + (refinement[1] if refinement else ""))
            resolved = _resolved_run(args, plan, {}, batch, None, save_dtype, None)
            (folder / RECIPE_FILE).write_text(resolved.to_yaml())
            replace_dir(folder, output)
            shutil.rmtree(store.folder, ignore_errors=True)  # written: nothing left to resume
        except BaseException:
            disk = staging_store(store)  # None before the store started, and on the ranks other than 0
            if disk is not None and not disk.has_layers():
                shutil.rmtree(disk.folder, ignore_errors=True)  # nothing worth resuming: leave no trace
            raise
        finally:
            if lead:
                shutil.rmtree(stage, ignore_errors=True)
    if comm is not None:
        leave_group()
    del hf_model  # --eval loads the written checkpoint instead
    summarize = lambda metrics: {  # noqa: E731
        "output": str(output), "method": plan.recipe.name, "scheme": p.name, "format": "compressed-tensors",
        "layout": float_checkpoint.layout_of(p), "quantized_linears": len(shapes),
        "streaming": layer_source is not None,
        "seconds": round(time.perf_counter() - t0, 3), "peak_rss_mb": _rss_mb(), **({"metrics": metrics} if metrics else {})}
    extra = {**({"placement": layer_source.placement()} if args["device_map"] is not None else {}),
             **({"ranks": comm.world, "collective_bytes": dict(comm.traffic)} if comm is not None else {}),
             **({"refinement": refinement[0]} if refinement else {})}
    return _finished(args, output, plan, resolved, summarize, extra, None)


def _kv_cache_scales(plan, hf_model, input_ids, batch, progress):
    """The calibrated FP8 KV-cache scales --kv-cache-scheme asks for (quantkit.kv_calibration), observed on
    the source model before any linear is quantized; None when not asked."""
    if plan.kv_cache is None:
        return None
    from quantkit.kv_calibration import calibrate_kv_scales

    return calibrate_kv_scales(hf_model, input_ids, plan.kv_cache, batch_size=batch or 8, progress=bool(progress))


def _integer_kv_scales(plan, hf_model, input_ids, batch, layer_source, comm, progress):
    """--kv-cache-scheme on the integer compressed-tensors writer: the scales observed on the source model
    before the pipeline quantizes (and releases) its layers; a resumed run observes them again on the same
    tokens, so they are the same. Needs the whole model in one process."""
    if plan.kv_cache is None:
        return None
    if layer_source is not None or comm is not None:
        raise QuantkitError("--kv-cache-scheme observes the whole model's keys and values in one process; drop "
                            "--streaming / --nproc (or drop --kv-cache-scheme)")
    return _kv_cache_scales(plan, hf_model, input_ids, batch, progress)


def _allocation(args: dict, plan, schemes: dict, layer_source, comm, hf_model, save_dtype):
    """None without a budget; else (the plan with the budget's mixture, the sensitivity report, the allocation)."""
    if args["target_bits"] is None and args["target_size"] is None:
        if args["sensitivity"] is not None:
            raise QuantkitError("--sensitivity is read by --target-bits/--target-size; add one or drop it")
        return None
    if args["target_bits"] is not None and args["target_size"] is not None:
        raise QuantkitError("--target-bits and --target-size are two budgets; give one")
    if layer_source is not None or comm is not None:
        raise QuantkitError("--target-bits/--target-size run in one process with the model in memory; drop "
                            "--streaming/--device-map/--nproc")
    from quantkit.allocation.budget import fixed_bytes
    from quantkit.allocation.run import allocate_plan

    return allocate_plan(args["model"], plan, schemes, target_bits=args["target_bits"],
                         target_size=args["target_size"], sensitivity=args["sensitivity"],
                         fixed=fixed_bytes(hf_model, set(schemes), save_dtype),
                         trust_remote_code=args["trust_remote_code"], progress=args["progress"])


def _plan_of(args: dict):
    from quantkit.plan import resolve_plan

    a = args
    return resolve_plan(a["method"], recipe_file=a["recipe"], options=a["options"], bits=a["bits"],
                        group_size=a["group_size"], sym=a["sym"], ignore=a["ignore"], format=a["format"],
                        gguf_type=a["gguf_type"], kv_cache_scheme=a["kv_cache_scheme"],
                        scheme=a["scheme"], calibration={k: a[k] for k in ("dataset", "num_samples", "seq_len", "seed", "chat_template",
                                                       "batch_size", "moe_calibration", "moe_min_tokens")})


def _run_spawned_ranks(args: dict) -> QuantizeResult:
    """quantize on `nproc` local ranks. Rank 0 sends back plain data (the summary and the calibration as
    drawn, without the dataset), not its plan, whose steps may hold tensors from the run; the plan is
    resolved here from the same arguments."""
    from quantkit.launch import run_local_ranks

    summary, calibration = run_local_ranks(int(args["nproc"]), _spawned_rank, args)
    plan = _plan_of(args)
    if calibration is not None:
        plan = replace(plan, calibration=replace(calibration, dataset=plan.calibration.dataset))
    return QuantizeResult(output=Path(summary["output"]), plan=plan, metrics=summary.get("metrics"), summary=summary)


def _spawned_rank(**kwargs):
    result = quantize(**kwargs)
    if result is None:
        return None
    c = result.plan.calibration
    return result.summary, replace(c, dataset=None) if c is not None else None


def _launched() -> bool:
    from quantkit.pipeline.distributed import launched_world

    return launched_world() > 1


def _source_model(model, tokenizer, trust_remote_code: bool, streaming, device_map, max_memory):
    """(model, tokenizer, name for the card, layer source or None): a folder/file/hub id is loaded as
    stored; an in-memory model is copied (quantkit.sources.copy_in_memory_model). A given tokenizer wins."""
    from quantkit.sources import copy_in_memory_model, load_source_model

    if isinstance(model, nn.Module):
        return (*copy_in_memory_model(model, tokenizer, streaming=streaming, device_map=device_map), None)
    hf_model, own_tokenizer, base_name, layer_source = load_source_model(
        model, dtype=None, trust_remote_code=trust_remote_code, streaming=streaming, device_map=device_map,
        max_memory=_max_memory(max_memory))
    return hf_model, tokenizer if tokenizer is not None else own_tokenizer, base_name, layer_source


def _in_memory_folder(model: nn.Module) -> Optional[str]:
    """The local folder an in-memory model was loaded from, if any (the output must not replace it)."""
    name = getattr(model, "name_or_path", "") or ""
    return name if name and Path(name).is_dir() else None


def _expert_policy(plan, adapter, hf_model, layer_source, comm=None):
    """The MoE calibration policy, None for a dense model (where MoE settings are refused)."""
    from quantkit.pipeline.experts import ExpertPolicy

    moe = any(adapter.moe_blocks(layer) for layer in adapter.decoder_layers(hf_model))
    c = plan.calibration
    if not moe:
        if c is not None and c.moe_given():
            raise QuantkitError(f"--moe-calibration/--moe-min-tokens apply to Mixture-of-Experts models; "
                                f"{hf_model.config.model_type} has no experts: drop them")
        return None
    if comm is not None:
        raise QuantkitError("data-parallel calibration of Mixture-of-Experts models is not supported yet (each "
                            "expert's routed tokens would need their own reduction); drop --nproc / torchrun")
    if plan.recipe.needs_reference_inputs:
        raise QuantkitError(f"method {plan.recipe.name!r} compares each linear's input with the unquantized "
                            "model's, which routed experts do not share (the routing differs); drop gptaq")
    if plan.gguf_type is not None:
        raise QuantkitError("GGUF export of Mixture-of-Experts models is not supported (llama.cpp stores experts "
                            "as 3-D tensors); use --format gptq, awq or compressed-tensors")
    return c.expert_policy() if c is not None else ExpertPolicy()


def vllm_moe_serving(plan, adapter, hf_model, schemes: dict) -> dict[str, Any]:
    """Which vLLM fused-MoE kernel will serve the experts (quantkit.formats.vllm_moe), with a notice
    when none will: the checkpoint still loads in quantkit (and, compressed-tensors, in transformers)."""
    from quantkit.formats.vllm_moe import moe_kernel
    from quantkit.notices import notice

    prefix, shapes = adapter.layers_prefix(hf_model), adapter.linear_shapes(hf_model)
    for i, layer in enumerate(adapter.decoder_layers(hf_model)):
        for block in adapter.moe_blocks(layer):
            name = f"{prefix}.{i}.{block.expert_linear(0, 'down_proj')}"
            if name not in schemes:
                continue
            (hidden, width), s = shapes[name], schemes[name]
            spec = plan.recipe.planned_spec(hidden, width, s)
            kernel, why = moe_kernel(plan.format, spec, hidden, width)
            if kernel is None:
                notice(f"quantkit: vLLM will not serve these experts ({why}); quantkit.load runs them")
            return {"vllm_moe_kernel": kernel, "why": why}
    return {"vllm_moe_kernel": None, "why": "no quantized experts"}


def moe_report(adapter, prefix: str, policy, stats: dict[int, dict], plan, serving=None) -> dict[str, Any]:
    """What `quantize --json`, the model card and `inspect` show of a MoE run: the policy, and per
    layer the min/median/max tokens per expert and every expert quantized without calibration."""
    from quantkit.pipeline.experts import summarize

    def name_of(index: int, block: str, e) -> str:
        return adapter.checkpoint_name(f"{prefix}.{index}.{block}" + ("" if e is None else f".{e}"))

    report: dict[str, Any] = {"calibration": "none (the method reads no data)"}
    if plan.calibration is not None:
        report = {"calibration": policy.mode, "min_tokens": policy.min_tokens,
                  "uncalibrated_method": plan.recipe.uncalibrated_method}
    report.update(serving or {})
    report["layers"] = summarize({i: s.get("experts", {}) for i, s in stats.items()}, name_of)
    report["per_expert"] = {name_of(i, block, None): entry for i, s in sorted(stats.items())
                            for block, entry in s.get("experts", {}).items()}
    return report


def _max_memory(value) -> Optional[dict]:
    from quantkit.placement import parse_max_memory

    return parse_max_memory(value) if isinstance(value, str) else value


_SPAWNED = object()  # _join_run's answer when this call must start the ranks itself (--nproc)


def _join_run(args: dict):
    """This call's place in a data-parallel run: None (one process), _SPAWNED (start `nproc` local
    ranks), or the communicator of the group a launcher (torchrun, --nproc) started."""
    from quantkit.pipeline.distributed import DEFAULT_TIMEOUT_S, check_world, join_group, launched_world, rank_device

    nproc, world = args["nproc"], launched_world()
    if nproc is not None and (isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1):
        raise QuantkitError(f"--nproc must be a positive integer, got {nproc!r}")
    if world == 1:
        if nproc is None or nproc == 1:
            return None
        check_world(nproc)
        return _SPAWNED
    if nproc is not None and nproc != world:
        raise QuantkitError(f"--nproc {nproc} inside a launched group of {world} ranks; drop --nproc under torchrun")
    timeout = float(args["dist_timeout"] or DEFAULT_TIMEOUT_S)
    return join_group(rank_device(args["device"]), timeout)


def _on_rank0(comm, check) -> None:
    """A check of the output folder made once (rank 0) and obeyed by every rank."""
    if comm is None:
        check()
    else:
        comm.from_rank0(lambda: (check(), b"")[1])


def _check_share(plan, comm) -> None:
    if comm is not None and plan.calibration is not None and plan.calibration.num_samples < comm.world:
        raise QuantkitError(f"--num-samples {plan.calibration.num_samples} leaves a rank without calibration samples; "
                            f"use at least {comm.world} (one per rank)")


def rough_checkpoint_bytes(model: nn.Module, schemes: dict, save_dtype: torch.dtype) -> int:
    """About what the checkpoint takes on disk (for a disk-full message): quantized weights at their
    bits plus an eighth for scales and zero points, everything else in `save_dtype`."""
    total = 0
    for name, param in model.named_parameters():  # tied weights are listed once
        owner = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and owner in schemes:
            total += param.numel() * getattr(schemes[owner], "bits", 16) * 9 // 64
        else:
            total += param.numel() * (save_dtype.itemsize if param.is_floating_point() else param.element_size())
    return total


def _checked_before_work(device: Optional[str], max_shard_size, dist_timeout: Optional[float], target_bits,
                         target_size) -> int:
    """Options otherwise first read after calibration or a sensitivity measurement (the shard size, the
    device, the budget), checked before any work so that a typo never costs a run; returns the shard
    size in bytes."""
    from quantkit.allocation.budget import parse_size
    from quantkit.devices import compute_device
    from quantkit.option_values import finite_number, shard_size_bytes

    compute_device(device)
    finite_number("--dist-timeout", dist_timeout, above=0)
    if target_bits is not None and (isinstance(target_bits, bool) or not isinstance(target_bits, (int, float))):
        raise QuantkitError(f"--target-bits must be a positive number, got {target_bits!r}")
    finite_number("--target-bits", target_bits, above=0)
    if target_size is not None and parse_size(target_size) < 1:
        raise QuantkitError(f"--target-size {target_size!r} must be more than 0 bytes; write e.g. 2.1GB or 700MiB")
    return shard_size_bytes(max_shard_size)


def _compute_device(device: Optional[str], comm) -> torch.device:
    if comm is None:
        from quantkit.devices import compute_device

        return compute_device(device)
    from quantkit.pipeline.distributed import rank_device

    return rank_device(device)


def _check_output(output: Path, overwrite: bool, resume: bool, model: Optional[str]) -> None:
    from quantkit.checkpoint import check_output_dir, staging_dir
    from quantkit.progress import ProgressStore
    from quantkit.sources import resolve_model_path

    check_output_dir(output, overwrite, source=Path(resolve_model_path(model)) if model is not None else None)
    ProgressStore(staging_dir(output)).check_leftover(resume)


def _linear_schemes(plan, hf_model, adapter) -> dict:
    """Every target linear's scheme (routed experts as per-expert linears); what the format cannot
    store is refused before calibrating."""
    from quantkit.formats import get_format

    shapes = adapter.linear_shapes(hf_model)
    schemes = plan.scheme.resolve(shapes)
    if plan.gguf_type is not None:  # each linear on the grid of the type llama-quantize would give it
        from quantkit.formats.gguf.export import linear_schemes

        schemes = linear_schemes(hf_model, plan.gguf_type, schemes, calibrated=plan.recipe.needs_calibration)
        if not schemes:
            raise QuantkitError(f"--gguf-type {plan.gguf_type} quantizes nothing; for a float GGUF use "
                                f"`quantkit convert MODEL --format gguf --gguf-type {plan.gguf_type}`")
        return schemes
    fmt = get_format(plan.format)
    for name, lin_scheme in schemes.items():
        try:
            fmt.packed_shapes(plan.recipe.planned_spec(*shapes[name], lin_scheme))
        except QuantkitError as err:
            raise QuantkitError(f"{name}: {err} (choose another --format or scheme)") from None
    return schemes


def _default_output(base_name: str, plan, schemes: dict) -> Path:
    groups = sorted({s.group_size for s in schemes.values()})
    g = groups[0] if len(groups) == 1 else "mixed"
    tag = "w8a8" if plan.recipe.quantizes_activations else f"w{plan.scheme.bits}" + ("pc" if g == -1 else f"g{g}")
    tag = plan.gguf_type.lower() if plan.gguf_type else tag
    return Path(f"{Path(base_name).name.lower()}-{plan.recipe.name.replace('+', '-')}-{tag}")


def _calibration_set(plan, hf_model, tokenizer, comm=None):
    """(plan, calibration token ids [num_samples, seq_len], sequences per forward); the plan's calibration
    then records the tokens' real shape, source and hash (quantkit.calibration_sources). (plan, None, None)
    without data. In a data-parallel run rank 0 draws the tokens and every rank receives the same."""
    from quantkit.calibration_sources import CalibrationTokens, calibration_tokens, check_vocabulary
    from quantkit.pipeline import calibration_batch_size

    c = plan.calibration
    if c is None:
        return plan, None, None
    draw = lambda: calibration_tokens(c.dataset, tokenizer, num_samples=c.given("num_samples"),  # noqa: E731
                                      seq_len=c.given("seq_len"), seed=c.seed, chat_template=c.chat_template)
    if comm is None:
        tokens = draw()
    else:
        from safetensors.torch import load, save

        drawn = {}
        ids = load(comm.from_rank0(lambda: save({"ids": drawn.setdefault("t", draw()).input_ids.contiguous()})))["ids"]
        source = comm.from_rank0(lambda: drawn["t"].source.encode()).decode()
        tokens = CalibrationTokens(ids, source)
    check_vocabulary(tokens.input_ids, hf_model.get_input_embeddings().num_embeddings)
    _check_calibration_context(tokens.input_ids.shape[1], hf_model.config)
    c = c.with_tokens(tokens)
    if plan.replay is not None:
        plan.replay.check_tokens(c.tokens_sha256)
    _check_share(replace(plan, calibration=c), comm)
    batch = c.batch_size or calibration_batch_size(hf_model.config, plan.recipe, c.num_samples, c.seq_len)
    return replace(plan, calibration=c), tokens.input_ids, batch


def _check_calibration_context(seq_len: int, config) -> None:
    """Calibrating on positions past the model's context fits the weights to activations it never serves
    (or fails on learned position embeddings): refuse, naming the limit."""
    from quantkit.scoring import context_length

    limit = context_length(config)
    if limit is not None and seq_len > limit:
        raise QuantkitError(f"calibration sequences of {seq_len} tokens exceed the model's context ({limit} tokens, "
                            f"max_position_embeddings); pass --seq-len {limit} or less")


def _progress_store(output: Path, model: str, plan, save_dtype, batch_size, input_ids, resume: bool, comm=None,
                    layout: Optional[str] = None):
    """The run's started progress store in the output's staging folder (data-parallel: rank 0's, replicated);
    `layout` names what is written where it is not `plan.format` (a float preset's compressed-tensors layout)."""
    from quantkit.checkpoint import staging_dir
    from quantkit.progress import ProgressStore, run_fingerprint

    def start() -> ProgressStore:
        store = ProgressStore(staging_dir(output))
        store.start(run_fingerprint(model=model, scheme=plan.scheme, method=plan.method_info(), dtype=save_dtype,
                                    format=layout or (f"gguf:{plan.gguf_type}" if plan.gguf_type else plan.format),
                                    batch_size=batch_size, version=__version__, calibration_digest=_digest(input_ids)),
                    resume=resume)
        return store

    if comm is None:
        return start()
    from quantkit.pipeline.distributed import ReplicatedStore

    box = {}
    comm.from_rank0(lambda: (box.setdefault("store", start()), b"")[1])
    return ReplicatedStore(box.get("store"), comm, input_ids.shape[0] if input_ids is not None else comm.world)


def _calibrate_and_write(hf_model, adapter, plan, schemes, input_ids, job: dict, output: Path, tokenizer,
                         base_name: str, save_dtype, max_shard_size: int, overwrite: bool,
                         recipe_yaml: str, kv_scales=None) -> Optional[dict]:
    """Calibrate, then write the checkpoint (with `recipe_yaml` as recipe.yaml, inside the staging folder so
    it lands with the rest, and `kv_scales` if any); returns the run's reports for its summary: a MoE model's
    calibration ("moe") and the refiners' per-layer choices ("refinement"), each only where there is one (None on
    the ranks that do not write)."""
    from quantkit.run_recipe import RECIPE_FILE

    from quantkit.checkpoint import write_checkpoint
    from quantkit.pipeline import quantize_model

    from quantkit.pipeline.distributed import staging_store

    serving = job.pop("serving", None)
    disk = staging_store(job["store"])  # the staging folder itself: None on the ranks other than 0
    try:
        quantize_model(hf_model, adapter, plan.recipe, schemes, input_ids, release_layers=True, **job)
        if disk is None:  # a rank other than 0: rank 0 writes
            return None
        ignore_names = sorted({n for n in adapter.linear_shapes(hf_model) if n not in schemes}
                              | set(adapter.full_precision_modules(hf_model)))
        moe = (moe_report(adapter, adapter.layers_prefix(hf_model), job["experts"], job["stats"], plan, serving)
               if job["experts"] is not None else None)
        refinement = plan.recipe.refinement_report(job["stats"])  # (summary, card section) or None
        if plan.gguf_type is not None:
            (disk.folder / RECIPE_FILE).write_text(recipe_yaml)
            _write_gguf(output, hf_model, tokenizer, disk, adapter.layers_prefix(hf_model), plan.gguf_type,
                        plan.method_info(), base_name, overwrite, calibrated=plan.recipe.needs_calibration)
        else:
            write_checkpoint(output, hf_model, tokenizer, disk, adapter.layers_prefix(hf_model), plan.format,
                             plan.method_info(), plan.recipe.format_extra(), base_name, save_dtype, ignore_names,
                             max_shard_size=max_shard_size, overwrite=overwrite, rename=adapter.checkpoint_name,
                             moe=moe, extra_files={RECIPE_FILE: recipe_yaml}, kv_scales=kv_scales,
                             card_extra=refinement[1] if refinement else "")
    except QuantkitError:
        if disk is not None and not disk.done_layers():
            shutil.rmtree(disk.folder, ignore_errors=True)  # nothing worth resuming: leave no trace
        raise
    return {**({"moe": moe} if moe else {}), **({"refinement": refinement[0]} if refinement else {})}


def _summary(output: Path, plan, schemes: dict, layer_source, cal_batch, t0: float, metrics) -> dict[str, Any]:
    bits_used = sorted({s.bits for s in schemes.values()})
    groups = sorted({s.group_size for s in schemes.values()})
    return {
        "output": str(output),
        "method": plan.recipe.name,
        "bits": bits_used[0] if len(bits_used) == 1 else bits_used,
        "group_size": groups[0] if len(groups) == 1 else groups,
        "sym": plan.scheme.sym,
        "format": plan.format,
        **({"gguf_type": plan.gguf_type} if plan.gguf_type else {}),
        "quantized_linears": len(schemes),
        "streaming": layer_source is not None,
        "calibration_batch_size": cal_batch,
        "seconds": round(time.perf_counter() - t0, 3),
        "peak_rss_mb": _rss_mb(),
        **({"metrics": metrics} if metrics else {}),
    }


def _write_gguf(output: Path, model, tokenizer, store, layers_prefix: str, gguf_type: str, method: dict,
                base_name: str, overwrite: bool, calibrated: bool) -> None:
    from quantkit.formats.gguf.export import record_fetch, write_gguf_folder
    from quantkit.progress import LAYER_DIR, RUN_FILE

    write_gguf_folder(output, store.folder, model, tokenizer, gguf_type, record_fetch(model, store, layers_prefix),
                      base_name, {**method, "gguf_type": gguf_type}, remove=(LAYER_DIR, RUN_FILE), overwrite=overwrite,
                      calibrated=calibrated)


def _rss_mb() -> Optional[float]:
    """Peak RSS in MB, None where the platform cannot tell (NaN would make invalid JSON)."""
    rss = peak_rss_mb()
    return None if math.isnan(rss) else round(rss, 1)


def _digest(input_ids: Optional[torch.Tensor]) -> Optional[str]:
    """Identifies the exact calibration tokens, so --resume refuses a run fed different data."""
    from quantkit.calibration_sources import tokens_sha256

    return None if input_ids is None else tokens_sha256(input_ids)


def _record_quality(output: Path, source_model: Optional[str], plan, device: Optional[str]) -> dict[str, Any]:
    """Score the written checkpoint (through the real packed runtime) against the model it came from, on
    the held-out split of the calibration dataset (the default's for in-memory data or a method that
    reads none), and add the figures to its model card. An in-memory source (None) has no folder to
    score as a baseline: perplexity only."""
    from quantkit.card_metadata import eval_model_index
    from quantkit.checkpoint import append_card_metrics
    from quantkit.plan import CALIBRATION_DEFAULTS

    dataset = plan.calibration.dataset if plan.calibration is not None else None
    eval_set = dataset if isinstance(dataset, (str, Path)) else CALIBRATION_DEFAULTS["dataset"]
    baseline = source_model if source_model is not None and (source_model == "demo" or Path(source_model).is_dir()) \
        else None
    r = evaluate(output, baseline=baseline, dataset=eval_set, device=device, seq_len=_eval_seq_len(output))
    metrics = {"perplexity dataset": f"{eval_set} (held-out split)", "perplexity tokens": r["tokens"],
               "held-out perplexity": round(r["perplexity"], 4)}
    if baseline is not None:
        metrics.update({"original model's perplexity": round(r["baseline_perplexity"], 4),
                        "KL divergence to the original (mean per token)": round(r["kl_mean"], 5),
                        **({"its standard error over windows": round(r["kl_mean_stderr"], 5)}
                           if r["kl_mean_stderr"] is not None else {}),
                        "KL divergence to the original (99th percentile)": round(r["kl_p99"], 5),
                        "top-1 agreement with the original": round(r["top1_agreement"], 5)})
    append_card_metrics(output, metrics, eval_model_index(eval_set, r, against_original=baseline is not None))
    return {**metrics, **{k: r[k] for k in ("kl_mean", "kl_p99", "top1_agreement", "baseline_perplexity") if k in r}}


EVAL_SEQ_LEN = 512  # evaluate's default window


def _eval_seq_len(output: Path) -> int:
    """quantize --eval's window: evaluate's default, cut to the model's context (with a notice) where
    that is shorter, as nothing past it would be a meaningful score."""
    from quantkit.notices import notice
    from quantkit.scoring import context_length

    limit = context_length(_config_on_disk(output) or {})
    if limit is not None and limit < EVAL_SEQ_LEN:
        notice(f"quantkit: --eval scores windows of {limit} tokens, the model's context (max_position_embeddings), "
               f"not {EVAL_SEQ_LEN}")
        return limit
    return EVAL_SEQ_LEN


def load(path: Union[str, Path], backend: str = "auto", device: Optional[str] = None, dtype: Optional[str] = None,
         trust_remote_code: bool = False):
    """Load a quantkit/gptq/awq/compressed-tensors checkpoint (or a plain HF model, or 'demo') for inference."""
    from quantkit.runtime.loader import load_model

    return load_model(str(path), backend=backend, device=device, dtype=dtype, trust_remote_code=trust_remote_code)


def evaluate(
    model: Union[str, Path],
    baseline: Optional[str] = None,
    dataset: Any = "lee",
    seq_len: int = 512,
    max_windows: Optional[int] = None,
    backend: str = "auto",
    dtype: Optional[str] = None,
    device: Optional[str] = None,
    batch_size: int = 4,
    progress: bool = False,
    engine: bool = False,
    baseline_cache: bool = True,
) -> dict[str, Any]:
    """Held-out perplexity of `model`; with a `baseline`, also how far its next-token distribution moved
    from the baseline's on the same windows: `kl_mean`, `kl_p99` (KL(baseline || model) per token),
    `top1_agreement`, and the baseline's perplexity.

    The baseline's side is cached on disk (`$QUANTKIT_CACHE/baselines`, keyed by the baseline's files,
    the eval tokens and the settings), so scoring another model against it costs that model's forward
    only. With `engine=True` the model's logits come from the paged-KV engine's prefill path (the code
    `quantkit bench` times); the baseline is always scored by its own forward."""
    from quantkit import data
    from quantkit.runtime.loader import load_tokenizer
    from quantkit.scoring import check_seq_len, compare, logits_of, perplexity, windows_of

    t0 = time.perf_counter()
    _check_eval_options(seq_len, max_windows, batch_size, device)
    for name in (model, baseline):  # before anything is loaded or scored, where the config is on disk
        if name is not None and _config_on_disk(name) is not None:
            check_seq_len(seq_len, _config_on_disk(name), str(name))
    tokenizer = load_tokenizer(str(model))
    windows = windows_of(data.eval_token_stream(dataset, tokenizer), seq_len, max_windows)
    out = {"model": str(model), "dataset": _dataset_label(dataset), "backend": backend, "engine": engine}
    base = None
    if baseline:
        base = _baseline_logits(baseline, windows, backend=backend, dtype=dtype, device=device, batch_size=batch_size,
                                progress=progress, cached=baseline_cache)
    qmodel = load(model, backend=backend, device=device, dtype=dtype)
    check_seq_len(seq_len, qmodel.config, str(model))  # a GGUF file's context is known only once loaded
    forward = logits_of(qmodel, _engine_fn(qmodel) if engine else None)
    if base is None:
        result = perplexity(qmodel, windows.reshape(-1), seq_len=seq_len, batch_size=batch_size, progress=progress,
                            logits_fn=forward)
        out.update(perplexity=result["perplexity"], tokens=result["tokens"], windows=result["windows"],
                   baseline_perplexity=None)
    else:
        result = compare(forward, base, windows, batch_size=batch_size, progress=progress)
        out.update(result, windows=int(windows.shape[0]), baseline=str(baseline), baseline_cache=base.cache,
                   ratio=result["perplexity"] / result["baseline_perplexity"])
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def _check_eval_options(seq_len: int, max_windows: Optional[int], batch_size: int, device: Optional[str]) -> None:
    """Counts and the device, before any model or text is read (a window needs 2 tokens: one predicts the next)."""
    from quantkit.devices import compute_device
    from quantkit.option_values import at_least

    at_least("--seq-len", seq_len, 2)
    at_least("--max-windows", max_windows)
    at_least("--batch-size", batch_size)
    compute_device(device)


def _config_on_disk(model) -> Optional[dict]:
    """config.json of a model folder (or the demo's), None for anything else (a GGUF file)."""
    from quantkit.runtime.loader import read_config
    from quantkit.sources import resolve_model_path

    folder = Path(resolve_model_path(str(model)))
    return read_config(folder) if (folder / "config.json").is_file() else None


def _dataset_label(dataset) -> str:
    return str(dataset) if isinstance(dataset, (str, Path)) else f"<{type(dataset).__name__}>"


def _baseline_logits(baseline: str, windows, *, backend, dtype, device, batch_size, progress, cached: bool):
    from quantkit.assets import cache_dir
    from quantkit.baseline_cache import baseline_logits
    from quantkit.runtime.loader import resolve_checkpoint

    folder = resolve_checkpoint(str(baseline)) if cached else None
    settings = {"dtype": str(dtype), "device": device, "backend": backend}
    return baseline_logits(lambda: load(baseline, backend=backend, device=device, dtype=dtype), folder, windows, settings,
                           cache_dir() / "baselines" if cached else None, batch_size=batch_size, progress=progress)


def _engine_fn(model):
    from quantkit.engine.llm_engine import engine_logits_fn

    return engine_logits_fn(model)


def sensitivity(model: str = "demo", method: Union[str, list, None] = "gptq", *, group_size=None, sym=None,
                format: Optional[str] = None, recipe=None, options: Optional[dict] = None,
                ignore: Optional[list[str]] = None, dataset: Any = None, num_samples: Optional[int] = None,
                seq_len: Optional[int] = None, seed: Optional[int] = None, eval_dataset: Any = None,
                eval_windows: int = 8, eval_seq_len: int = 512, sample: int = 8, measure_layers: bool = True,
                measure_linears: bool = True, measure_at=None, candidate_bits=(2, 3, 4, 8), output: Union[str, Path, None] = None, overwrite: bool = False,
                trust_remote_code: bool = False, progress: bool = True) -> dict[str, Any]:
    """Measure how much each linear's quantization costs in KL at each candidate bit width (the
    method's group size and symmetry) and write the report (sensitivity.json, PNG pictures, HTML page)
    into `output`; returns a summary. See quantkit.allocation.sensitivity and docs/allocation.md."""
    from quantkit.allocation.report import write_report
    from quantkit.allocation.run import sensitivity_of_model
    from quantkit.plan import resolve_plan
    from quantkit.scheme import check_bits

    for b in candidate_bits:  # a bit width, or a scheme label (w4g128) that the candidate parser checks
        if isinstance(b, int):
            check_bits(b)
    plan = resolve_plan(method, recipe_file=recipe, options=options, group_size=group_size, sym=sym, ignore=ignore,
                        format=format)
    out = Path(output) if output is not None else Path(f"{Path(str(model)).name.lower()}-sensitivity")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise QuantkitError(f"--output {out} exists and is not empty; pass --overwrite or choose another folder")
    say = (lambda s: print(f"sensitivity: {s}", flush=True)) if progress else (lambda s: None)
    given = {k: v for k, v in (("dataset", dataset), ("num_samples", num_samples), ("seq_len", seq_len),
                               ("seed", seed)) if v is not None}
    report = sensitivity_of_model(str(model), plan, calibration=given, trust_remote_code=trust_remote_code,
                                  eval_dataset=eval_dataset, eval_windows=eval_windows, eval_seq_len=eval_seq_len,
                                  sample=sample, measure_layers=measure_layers, measure_linears=measure_linears,
                                  measure_at=measure_at,
                                  bits=tuple(candidate_bits),
                                  progress=say)
    files = write_report(out, report)
    return {"output": str(out), "files": files, "rows": len(report["rows"]), "linears": len({r["linear"] for r in report["rows"]}),
            "schemes": report["schemes"], "calibration_mode": report["calibration_mode"],
            "proxy_check": report["proxy_check"], "uniform": report["uniform"],
            "interaction_check": report["interaction"]["check"], "seconds": report["seconds"]}
