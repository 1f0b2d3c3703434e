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
) -> dict[str, Any]:
    """Quantize `model` with `method` and write a packed checkpoint; returns a summary dict.

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
    fmt = get_format(format_name)
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
    for name, lin_scheme in schemes.items():  # refuse what the format cannot store before calibrating
        try:
            fmt.packed_shapes(quantizer.planned_spec(*shapes[name], lin_scheme))
        except QuantkitError as err:
            raise QuantkitError(f"{name}: {err} (choose another --format or scheme)") from None
    groups = sorted({s.group_size for s in schemes.values()})
    if output is None:
        g = groups[0] if len(groups) == 1 else "mixed"
        tag = "w8a8" if quantizer.quantizes_activations else f"w{scheme.bits}" + ("pc" if g == -1 else f"g{g}")
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
    store.start(run_fingerprint(model=model, scheme=scheme, format=format_name, method=method_info, dtype=save_dtype,
                                batch_size=batch_size, chat_template=chat_template, version=__version__,
                                calibration_digest=_digest(input_ids)), resume=resume)
    try:
        quantize_model(hf_model, adapter, quantizer, schemes, input_ids, device=compute_device,
                       batch_size=batch_size, progress=progress, store=store, layer_source=layer_source,
                       release_layers=True)
        ignore_names = sorted(n for n in linear_shapes(hf_model) if n not in schemes)
        write_checkpoint(output, hf_model, tokenizer, store, adapter.layers_prefix(hf_model), format_name, method_info,
                         quantizer.format_extra(), base_name, save_dtype, ignore_names, max_shard_size=max_shard_size,
                         overwrite=overwrite)
    except QuantkitError:
        if not store.done_layers():
            shutil.rmtree(store.folder, ignore_errors=True)  # nothing worth resuming: leave no trace
        raise
    metrics = None
    if eval_after:
        del hf_model
        metrics = _record_quality(output, model, dataset, device)
    bits_used = sorted({s.bits for s in schemes.values()})
    return {
        "output": str(output),
        "method": quantizer.name,
        "bits": bits_used[0] if len(bits_used) == 1 else bits_used,
        "group_size": groups[0] if len(groups) == 1 else groups,
        "format": format_name,
        "quantized_linears": len(schemes),
        "streaming": layer_source is not None,
        "calibration_batch_size": batch_size if quantizer.needs_calibration else None,
        "seconds": round(time.perf_counter() - t0, 3),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        **({"metrics": metrics} if metrics else {}),
    }


def _digest(input_ids: Optional[torch.Tensor]) -> Optional[str]:
    """Identifies the exact calibration tokens, so --resume refuses a run fed different data."""
    if input_ids is None:
        return None
    return hashlib.sha256(input_ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def _record_quality(output: Path, source_model: str, dataset, device: Optional[str]) -> dict[str, Any]:
    """Score the written checkpoint (through the real packed runtime) against the model it came from, on
    the held-out split of the calibration dataset, and add the figures to its model card."""
    from quantkit.checkpoint import append_card_metrics

    eval_set = dataset if isinstance(dataset, (str, Path)) else DEFAULTS["dataset"]
    baseline = source_model if source_model == "demo" or Path(source_model).is_dir() else None
    r = evaluate(output, baseline=baseline, dataset=eval_set, device=device)
    metrics = {"perplexity dataset": f"{eval_set} (held-out split)", "perplexity tokens": r["tokens"],
               "held-out perplexity": round(r["perplexity"], 4)}
    if baseline is not None:
        metrics.update({"original model's perplexity": round(r["baseline_perplexity"], 4),
                        "KL divergence to the original (mean per token)": round(r["kl_mean"], 5),
                        "KL divergence to the original (99th percentile)": round(r["kl_p99"], 5),
                        "top-1 agreement with the original": round(r["top1_agreement"], 5)})
    append_card_metrics(output, metrics)
    return {**metrics, **{k: r[k] for k in ("kl_mean", "kl_p99", "top1_agreement", "baseline_perplexity") if k in r}}


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
    from quantkit.scoring import compare, logits_of, perplexity, windows_of

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(str(model))
    windows = windows_of(data.eval_token_stream(dataset, tokenizer), seq_len, max_windows)
    out = {"model": str(model), "dataset": _dataset_label(dataset), "backend": backend, "engine": engine}
    base = None
    if baseline:
        base = _baseline_logits(baseline, windows, backend=backend, dtype=dtype, device=device, batch_size=batch_size,
                                progress=progress, cached=baseline_cache)
    qmodel = load(model, backend=backend, device=device, dtype=dtype)
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
