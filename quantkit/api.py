"""The Python surface: `quantize`, `load`, `evaluate`. The CLI is a thin shell over these."""
from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from quantkit import __version__
from quantkit.errors import QuantkitError
from quantkit.memory import peak_rss_mb
from quantkit.quantizers.base import Quantizer, get_quantizer
from quantkit.scheme import QuantScheme, load_recipe, parse_group_size, scheme_from_dict

DEFAULTS = {"bits": 4, "group_size": "auto", "num_samples": 128, "seq_len": 512, "seed": 0, "dataset": "lee"}


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    return {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _merge(recipe: dict, key: str, section: Optional[str], explicit):
    """CLI/API values win over the recipe, the recipe over the defaults."""
    if explicit is not None:
        return explicit
    source = recipe.get(section, {}) if section else recipe
    if source and key in source and source[key] is not None:
        return source[key]
    return DEFAULTS.get(key)


def quantize(
    model: str = "demo",
    method: Union[str, Quantizer, None] = None,
    *,
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
    max_shard_size: str = "5GB",
    chat_template: bool = False,
    batch_size: Optional[int] = None,
    eval_after: bool = False,
    progress: bool = True,
    resume: bool = False,
    streaming: Optional[bool] = None,
    gguf_type: Optional[str] = None,
) -> dict[str, Any]:
    """Quantize `model` with `method` and write a packed checkpoint; returns a summary dict.

    With format="gguf" the weights are quantized onto the blocks of `gguf_type` (a llama.cpp type
    or mix, default the one matching bits/sym) and written as `<output>/model.gguf`.

    Progress is kept per layer in the output's hidden staging folder: after a crash, the same call
    with `resume=True` continues from the last finished layer and writes identical bytes.
    `streaming=None` reads decoder layers from disk one at a time when the model would not fit
    comfortably in memory (True/False force it)."""
    from quantkit import data
    from quantkit.calibrate import (CALIBRATION_BATCH_BUDGET, STAGED_BATCH_BUDGET, auto_batch_size, quantize_model,
                                    runs_in_one_pass)
    from quantkit.checkpoint import check_output_dir, staging_dir, write_checkpoint
    from quantkit.progress import ProgressStore, run_fingerprint
    from quantkit.formats import get_format
    from quantkit.models import get_adapter
    from quantkit.sources import load_source_model, parse_dtype, source_dtype

    t0 = time.perf_counter()
    rec = load_recipe(recipe) if recipe else {}
    quantizer = _make_quantizer(method if method is not None else rec.get("method", "rtn"), {**(rec.get("options") or {}), **(options or {})})
    scheme_dict = {**quantizer.default_scheme, **(rec.get("scheme") or {})}
    for key, value in (("bits", bits), ("group_size", parse_group_size(group_size)), ("sym", sym)):
        if value is not None:
            scheme_dict[key] = value
    if ignore is not None:
        scheme_dict["ignore"] = ignore
    scheme: QuantScheme = scheme_from_dict(scheme_dict).with_default_sym(quantizer.default_sym)
    quantizer.check_scheme(scheme)
    format_name = format or rec.get("format") or quantizer.default_format
    is_gguf = str(format_name).lower() == "gguf"
    if is_gguf:
        from quantkit.ggml_types import check_gguf_type
        from quantkit.gguf_export import default_gguf_type

        if not quantizer.supports_grids:
            raise QuantkitError(f"method {quantizer.name!r} cannot quantize onto GGUF's block grids; use --method gptq or rtn")
        gguf_type = check_gguf_type(gguf_type or default_gguf_type(scheme.bits, scheme.sym))
        format_name = "gguf"
    elif gguf_type is not None:
        raise QuantkitError("--gguf-type needs --format gguf")
    fmt = None if is_gguf else get_format(format_name)
    if quantizer.quantizes_activations and not getattr(fmt, "ACTIVATION_STRATEGIES", None):
        raise QuantkitError(f"method {quantizer.name!r} quantizes activations (W8A8), which the {fmt.NAME} format "
                            "cannot store; use --format compressed-tensors")
    cal = rec.get("calibration") or {}
    dataset = dataset if dataset is not None else cal.get("dataset", DEFAULTS["dataset"])
    num_samples = int(_merge(rec, "num_samples", "calibration", num_samples))
    seq_len = int(_merge(rec, "seq_len", "calibration", seq_len))
    seed = int(_merge(rec, "seed", "calibration", seed))
    if num_samples < 1 or seq_len < 2:
        raise QuantkitError("--num-samples must be at least 1 and --seq-len at least 2")
    if output is not None:
        check_output_dir(Path(output), overwrite)
        ProgressStore(staging_dir(Path(output))).check_leftover(resume)
    compute_device = torch.device(device or "cpu")

    # held in its storage dtype (bf16 halves the resident model); each decoder layer is cast to fp32
    # only while it is calibrated (exact), and capture_layer_inputs runs the embeddings in fp32
    hf_model, tokenizer, base_name, layer_source = load_source_model(
        model, dtype=None, trust_remote_code=trust_remote_code, streaming=streaming)
    save_dtype = parse_dtype(dtype) or source_dtype(hf_model.config)
    adapter = get_adapter(hf_model)
    shapes = linear_shapes(hf_model)
    schemes = scheme.resolve(shapes)
    if is_gguf:  # each linear on the grid of the type llama-quantize would give it
        from quantkit.gguf_export import linear_schemes

        schemes = linear_schemes(hf_model, gguf_type, schemes)
        if not schemes:
            raise QuantkitError(f"--gguf-type {gguf_type} quantizes nothing; for a float GGUF use "
                                f"`quantkit convert MODEL --format gguf --gguf-type {gguf_type}`")
    for name, lin_scheme in ({} if is_gguf else schemes).items():  # refuse what the format cannot store
        try:
            fmt.packed_shapes(quantizer.planned_spec(*shapes[name], lin_scheme))
        except QuantkitError as err:
            raise QuantkitError(f"{name}: {err} (choose another --format or scheme)") from None
    groups = sorted({s.group_size for s in schemes.values()})
    if output is None:
        g = groups[0] if len(groups) == 1 else "mixed"
        tag = "w8a8" if quantizer.quantizes_activations else f"w{scheme.bits}" + ("pc" if g == -1 else f"g{g}")
        tag = gguf_type.lower() if is_gguf else tag
        output = Path(f"{Path(base_name).name.lower()}-{quantizer.name}-{tag}")
        check_output_dir(output, overwrite)
        ProgressStore(staging_dir(output)).check_leftover(resume)
    output = Path(output)

    input_ids = None
    if quantizer.needs_calibration:
        input_ids = data.calibration_batches(dataset, tokenizer, num_samples=num_samples, seq_len=seq_len, seed=seed,
                                             chat_template=chat_template)
    method_info = {**quantizer.describe(), "seed": seed}
    if quantizer.needs_calibration:
        method_info.update({"calibration": str(dataset) if isinstance(dataset, (str, Path)) else type(dataset).__name__,
                            "num_samples": num_samples, "seq_len": seq_len})
    if batch_size is None:
        budget = CALIBRATION_BATCH_BUDGET if runs_in_one_pass(quantizer) else STAGED_BATCH_BUDGET
        batch_size = auto_batch_size(hf_model.config, num_samples, seq_len, torch.float32, budget)
    elif batch_size < 1:
        raise QuantkitError(f"--batch-size must be at least 1, got {batch_size}")
    store = ProgressStore(staging_dir(output))
    store.start(run_fingerprint(model=model, scheme=scheme, format=f"gguf:{gguf_type}" if is_gguf else format_name,
                                method=method_info, dtype=save_dtype,
                                batch_size=batch_size, chat_template=chat_template, version=__version__,
                                calibration_digest=_digest(input_ids)), resume=resume)
    try:
        quantize_model(hf_model, adapter, quantizer, schemes, input_ids, device=compute_device,
                       batch_size=batch_size, progress=progress, store=store, layer_source=layer_source,
                       release_layers=True)
        ignore_names = sorted(n for n in linear_shapes(hf_model) if n not in schemes)
        if is_gguf:
            _write_gguf(output, hf_model, tokenizer, store, adapter.layers_prefix(hf_model), gguf_type, method_info,
                        base_name, overwrite)
        else:
            write_checkpoint(output, hf_model, tokenizer, store, adapter.layers_prefix(hf_model), format_name,
                             method_info, quantizer.format_extra(), base_name, save_dtype, ignore_names,
                             max_shard_size=max_shard_size, overwrite=overwrite)
    except QuantkitError:
        if not store.done_layers():
            shutil.rmtree(store.folder, ignore_errors=True)  # nothing worth resuming: leave no trace
        raise
    metrics = None
    if eval_after:
        del hf_model
        metrics = _record_perplexity(output, dataset)
    bits_used = sorted({s.bits for s in schemes.values()})
    return {
        "output": str(output),
        "method": quantizer.name,
        "bits": bits_used[0] if len(bits_used) == 1 else bits_used,
        "group_size": groups[0] if len(groups) == 1 else groups,
        "format": format_name,
        **({"gguf_type": gguf_type} if is_gguf else {}),
        "quantized_linears": len(schemes),
        "streaming": layer_source is not None,
        "calibration_batch_size": batch_size if quantizer.needs_calibration else None,
        "seconds": round(time.perf_counter() - t0, 3),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        **({"metrics": metrics} if metrics else {}),
    }


def _write_gguf(output: Path, model, tokenizer, store, layers_prefix: str, gguf_type: str, method: dict,
                base_name: str, overwrite: bool) -> None:
    from quantkit.gguf_export import record_fetch, write_gguf_folder
    from quantkit.progress import LAYER_DIR, RUN_FILE

    write_gguf_folder(output, store.folder, model, tokenizer, gguf_type, record_fetch(model, store, layers_prefix),
                      base_name, {**method, "gguf_type": gguf_type}, remove=(LAYER_DIR, RUN_FILE), overwrite=overwrite)


def _digest(input_ids: Optional[torch.Tensor]) -> Optional[str]:
    """Identifies the exact calibration tokens, so --resume refuses a run fed different data."""
    if input_ids is None:
        return None
    return hashlib.sha256(input_ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def _record_perplexity(output: Path, dataset) -> dict[str, Any]:
    """Score the written checkpoint (through the real packed runtime) and add it to its model card."""
    from quantkit.checkpoint import append_card_metrics

    r = evaluate(output, dataset=dataset if isinstance(dataset, (str, Path)) else DEFAULTS["dataset"])
    metrics = {"held-out perplexity": round(r["perplexity"], 4), "perplexity tokens": r["tokens"],
               "perplexity dataset": str(dataset)}
    append_card_metrics(output, metrics)
    return metrics


# Recipe pipelines (`method: [a, b]`) that one quantizer implements, with the options they imply.
PIPELINES = {("smoothquant", "gptq"): ("smoothquant", {"weight_method": "gptq"}),
             ("smoothquant", "rtn"): ("smoothquant", {"weight_method": "rtn"})}


def _make_quantizer(method: Union[str, Quantizer, list], options: dict) -> Quantizer:
    if isinstance(method, Quantizer):
        return method
    if isinstance(method, type) and issubclass(method, Quantizer):
        return method(**options)
    if isinstance(method, (list, tuple)):
        steps = tuple(str(m).strip().lower() for m in method)
        if len(steps) == 1:
            return get_quantizer(steps[0], **options)
        if steps not in PIPELINES:
            known = ", ".join("[" + ", ".join(k) + "]" for k in PIPELINES)
            raise QuantkitError(f"unsupported method pipeline {list(steps)}; supported: {known}")
        name, implied = PIPELINES[steps]
        return get_quantizer(name, **{**options, **implied})
    return get_quantizer(str(method), **options)


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
) -> dict[str, Any]:
    """Held-out perplexity of `model`, and of `baseline` on the same tokens when given.

    With `engine=True` the logits come from the paged-KV engine's prefill path, so perplexity is
    measured through the same code that `quantkit bench` times."""
    from quantkit import data
    from quantkit.evaluate import perplexity
    from quantkit.runtime.loader import load_tokenizer

    t0 = time.perf_counter()
    qmodel = load(model, backend=backend, device=device, dtype=dtype)
    tokenizer = load_tokenizer(str(model))
    stream = data.eval_token_stream(dataset, tokenizer)
    result = perplexity(qmodel, stream, seq_len=seq_len, max_windows=max_windows, batch_size=batch_size, progress=progress,
                        logits_fn=_engine_fn(qmodel) if engine else None)
    out = {"model": str(model), "perplexity": result["perplexity"], "tokens": result["tokens"], "windows": result["windows"],
           "backend": backend, "engine": engine}
    del qmodel
    if baseline:
        base = load(baseline, backend=backend, device=device, dtype=dtype)
        base_result = perplexity(base, stream, seq_len=seq_len, max_windows=max_windows, batch_size=batch_size,
                                 progress=progress, logits_fn=_engine_fn(base) if engine else None)
        out["baseline"] = str(baseline)
        out["baseline_perplexity"] = base_result["perplexity"]
        out["ratio"] = result["perplexity"] / base_result["perplexity"]
    else:
        out["baseline_perplexity"] = None
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def _engine_fn(model):
    from quantkit.engine.llm_engine import engine_logits_fn

    return engine_logits_fn(model)
