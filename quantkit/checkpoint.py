"""Writing a packed, Hub-ready checkpoint folder, atomically.

Everything goes into the run's hidden staging folder beside the destination (where the per-layer
progress already lives, see progress.py) and is renamed into place at the end, so an interrupted run never leaves a half-written output and never touches what the user
already had there. Tensors are packed by the format module (the same one the loader unpacks with).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any, Optional

import torch

from quantkit import __version__
from quantkit.card_metadata import front_matter, is_hub_id, render_front_matter, repacked_base, with_model_index
from quantkit.errors import QuantkitError
from quantkit.formats import get_format
from quantkit.formats.spec import LinearSpec
from quantkit.progress import LAYER_DIR, RUN_FILE, ProgressStore
from quantkit.streaming import trim_heap


def staging_dir(output: Path) -> Path:
    return output.parent / f".{output.name}.partial"


def check_output_dir(output: Path, overwrite: bool, source: Optional[Path] = None) -> None:
    """Fail before any work if the destination would clobber the user's files (the `source` model
    among them) or a leftover run exists."""
    if source is not None:
        check_not_source(Path(output), Path(source), overwrite)
    if output.exists() and not output.is_dir():
        raise QuantkitError(f"output {output} exists and is not a folder; choose another --output")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise QuantkitError(f"output folder {output} is not empty; pass --overwrite or choose another --output")


def check_not_source(output: Path, source: Path, overwrite: bool) -> None:
    """The output replaces its folder wholesale (replace_dir): it must not be the source model, nor a
    folder holding it, nor (with --overwrite) a non-empty folder inside it, whose files it would delete.
    A new or empty folder inside the source folder is fine: no source file is touched."""
    if not source.exists():
        return  # a hub id: its files live in the hub cache, which no --output names by accident
    src, out = source.resolve(), output.resolve()
    if out == src or out in src.parents:
        raise QuantkitError(f"--output {output} {'is' if out == src else 'contains'} the source model {source}, "
                            "which writing the output would delete; choose another --output")
    if overwrite and src in out.parents and out.is_dir() and any(out.iterdir()):
        raise QuantkitError(f"--output {output} is a non-empty folder inside the source model {source}, which "
                            "--overwrite would delete; choose another --output")


PACKED_DIR = "packed"  # per-layer packed tensors, written during the final write and removed before the rename


def plan_tensors(model, store: ProgressStore, layers_prefix: str, format_name: str, save_dtype: torch.dtype,
                 scratch: Path, rename=None) -> tuple[dict[str, tuple[Optional[Path], torch.dtype, tuple[int, ...]]],
                                                      dict[str, LinearSpec]]:
    """Every tensor of the checkpoint as name -> (where it lives, dtype, shape), in state-dict order.

    Unquantized non-layer tensors stay in the model (where = None) and are cast to `save_dtype`
    only when written. Each decoder layer is read from its progress record, its quantized linears
    are packed by the format module (the same one the loader unpacks with), and the result goes to
    `scratch/layer-*.safetensors`: only one layer is ever in memory, whatever the model's depth.
    `rename` gives a layer tensor's name in the family's checkpoints (Mixtral's block_sparse_moe.w1)."""
    from safetensors.torch import save_file

    fmt = get_format(format_name)
    rename = rename or (lambda name: name)
    entries: dict[str, tuple[Optional[Path], torch.dtype, tuple[int, ...]]] = {}
    specs: dict[str, LinearSpec] = {}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for key, tensor in model.state_dict().items():
        if key.startswith(layers_prefix + ".") or (tied and key == "lm_head.weight"):
            continue
        entries[key] = (None, save_dtype if tensor.is_floating_point() else tensor.dtype, tuple(tensor.shape))
    scratch.mkdir(parents=True, exist_ok=True)
    for index in store.done_layers():
        record = store.load_layer(index)
        packed: dict[str, torch.Tensor] = {}
        for name, qw in record.quantized.items():
            name = rename(name)
            for suffix, tensor in fmt.pack(qw).items():
                packed[f"{name}.{suffix}"] = tensor.contiguous()
            if qw.bias is not None:
                packed[f"{name}.bias"] = qw.bias.to(torch.float16).contiguous()
            specs[name] = LinearSpec.of(qw)
        for key, tensor in record.other.items():
            packed[rename(key)] = _cast(tensor, save_dtype)
        path = scratch / f"layer-{index:05d}.safetensors"
        save_file(packed, str(path))
        for key, tensor in packed.items():
            entries[key] = (path, tensor.dtype, tuple(tensor.shape))
        del record, packed
        trim_heap()
    return entries, specs


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = tensor.detach()
    return (t.to(dtype) if t.is_floating_point() else t).contiguous().clone()


def write_checkpoint(
    output: Path,
    model,
    tokenizer,
    store: ProgressStore,
    layers_prefix: str,
    format_name: str,
    method: dict[str, Any],
    format_extra: dict[str, Any],
    base_model: str,
    save_dtype: torch.dtype,
    ignore: list[str],
    max_shard_size: str = "5GB",
    overwrite: bool = False,
    rename=None,
    moe: Optional[dict[str, Any]] = None,
    extra_files: Optional[dict[str, str]] = None,
    kv_scales=None,
    card_extra: str = "",
) -> Path:
    """Write the checkpoint into the run's staging folder, drop the progress files, rename into place.
    `rename` maps layer tensor names to the family's checkpoint names; `moe` is a MoE run's report
    (model card section and MOE_REPORT); `extra_files` {name: text} land with the rest (recipe.yaml);
    `kv_scales` (quantkit.kv_calibration.KVScales, compressed-tensors only) adds the attention modules'
    k_scale / v_scale tensors and the config's kv_cache_scheme; `card_extra` is appended to the model card
    (the refiners' section)."""
    output = Path(output)
    check_output_dir(output, overwrite)
    fmt = get_format(format_name)
    stage = store.folder
    for stale in [p for p in stage.iterdir() if p.name not in (LAYER_DIR, RUN_FILE)]:
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()  # a crash during an earlier final write
    entries, specs = plan_tensors(model, store, layers_prefix, format_name, save_dtype, stage / PACKED_DIR, rename)
    if kv_scales is not None:
        entries.update(_kv_scale_entries(kv_scales, stage / PACKED_DIR, rename))
    _save_sharded(entries, model, save_dtype, stage, max_shard_size)
    shutil.rmtree(stage / PACKED_DIR)
    qcfg = fmt.quantization_config(specs, [rename(n) for n in ignore] if rename else ignore, format_extra)
    if kv_scales is not None:
        if "kv_cache_scheme" not in qcfg:  # checked where it is relied on; the plan already refuses other formats
            raise QuantkitError(f"the {format_name} format has no kv_cache_scheme for the KV-cache scales")
        qcfg["kv_cache_scheme"] = kv_scales.scheme.config()
    _save_config(model, stage, qcfg, save_dtype)
    if tokenizer is not None:
        tokenizer.save_pretrained(stage)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(stage)
        except (ValueError, OSError):
            pass
    card = model_card(base_model, format_name, method, qcfg, specs)
    _notice_vllm_refusal(format_name, specs)
    if moe is not None:
        card += moe_card_section(moe)
        (stage / MOE_REPORT).write_text(json.dumps(moe, indent=1, sort_keys=True) + "\n")
    (stage / "README.md").write_text(card + card_extra)
    for name, text in (extra_files or {}).items():
        (stage / name).write_text(text)
    shutil.rmtree(stage / LAYER_DIR)
    (stage / RUN_FILE).unlink()
    normal_permissions(stage)
    replace_dir(stage, output)
    return output


def _kv_scale_entries(kv_scales, scratch: Path, rename) -> dict[str, tuple[Path, torch.dtype, tuple[int, ...]]]:
    """The KV-cache scale tensors saved beside the packed layers, as `plan_tensors` entries (float32, as
    compressed-tensors and vLLM keep them; never cast to the checkpoint's dtype)."""
    from safetensors.torch import save_file

    tensors = kv_scales.tensors(rename or (lambda name: name))
    path = scratch / "kv-cache-scales.safetensors"
    save_file(tensors, str(path))
    return {key: (path, t.dtype, tuple(t.shape)) for key, t in tensors.items()}


def _save_sharded(entries: dict[str, tuple[Optional[Path], torch.dtype, tuple[int, ...]]], model,
                  save_dtype: torch.dtype, folder: Path, max_shard_size) -> None:
    """The checkpoint's tensors (scratch files of quantized layers, the rest from `model` cast to
    `save_dtype`) written as shards, tensor by tensor (`write_shards`)."""
    model_state = model.state_dict()

    def load(key: str) -> torch.Tensor:
        path = entries[key][0]
        if path is None:
            t = model_state[key].detach()
            return t.to(save_dtype) if t.is_floating_point() else t
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:  # opened per tensor: nothing stays mapped
            return f.get_tensor(key)

    write_shards({k: entries[k][1:] for k in entries}, load, folder, max_shard_size)


def write_shards(layout: dict[str, tuple[torch.dtype, tuple[int, ...]]], load, folder: Path, max_shard_size) -> None:
    """Shard like `save_pretrained` (huggingface_hub's split, in `layout`'s order: name -> (dtype, shape))
    and write each shard tensor by tensor (`load(name)`), so peak memory is one tensor, not the
    checkpoint (or a 5 GB shard); the index is written when there is more than one shard. One
    implementation for every safetensors checkpoint quantkit writes (integer and float)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    sizes = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (dtype, shape) in layout.items()}
    try:
        split = split_torch_state_dict_into_shards(sizes, max_shard_size=max_shard_size,
                                                   filename_pattern="model{suffix}.safetensors")
    except ValueError as exc:
        raise QuantkitError(f"invalid --max-shard-size {max_shard_size!r}: {exc}; use e.g. 2GB or 500MB") from None
    for filename, keys in split.filename_to_tensors.items():
        write_safetensors(folder / filename, {k: layout[k] for k in keys}, load, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sizes.values())},
                 "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


# safetensors' own order (its Rust Dtype enum): `save_file` lays tensors out by descending dtype,
# then by name, so every tensor starts aligned to its element size. Writing the same layout here
# keeps files byte-identical to `save_file` of the same tensors.
_ST_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e5m2: "F8_E5M2",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
              torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.int16: "I16", torch.uint16: "U16", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32", torch.float32: "F32",
              torch.complex64: "C64", torch.float64: "F64", torch.int64: "I64", torch.uint64: "U64"}
_ST_RANK = {dtype: rank for rank, dtype in enumerate(_ST_DTYPES)}


def write_safetensors(path: Path, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]], load,
                      metadata: Optional[dict[str, str]] = None) -> None:
    """Write a safetensors file whose tensors (name -> (dtype, shape)) are fetched one at a time by
    `load(name)`; the bytes equal `safetensors.torch.save_file` of the same tensors."""
    for name, (dtype, _) in layout.items():
        if dtype not in _ST_DTYPES:
            raise QuantkitError(f"cannot store tensor {name} of dtype {dtype} in safetensors")
    order = sorted(layout, key=lambda k: (-_ST_RANK[layout[k][0]], k))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        dtype, shape = layout[name]
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in order:
            dtype, shape = layout[name]
            t = load(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise QuantkitError(f"internal: tensor {name} changed to {t.dtype}{list(t.shape)} while writing "
                                    f"(planned {dtype}{list(shape)})")
            if t.numel():
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del t


def _save_config(model, folder: Path, qcfg: dict, save_dtype: torch.dtype) -> None:
    config = model.config.to_diff_dict()
    for key in ("_name_or_path", "source_dtype", "transformers_version"):
        config.pop(key, None)
    config["quantization_config"] = qcfg
    config["dtype"] = str(save_dtype).replace("torch.", "")
    config.pop("torch_dtype", None)
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def normal_permissions(folder: Path) -> None:
    """Staged files may be created private (0600); a checkpoint is meant to be shared."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def replace_dir(stage: Path, output: Path) -> None:
    """Rename the finished staging folder into place; an old output (with --overwrite) goes only after."""
    old = None
    if output.exists():
        old = output.parent / f".{output.name}.old-{os.getpid()}-{int(time.time())}"
        os.replace(output, old)
    os.replace(stage, output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


MOE_REPORT = "moe_calibration.json"  # per layer and expert: calibration tokens, routing, experts left uncalibrated


def moe_card_section(moe: dict[str, Any]) -> str:
    """The model card's Mixture-of-Experts section: how experts were calibrated, per layer the
    min/median/max tokens per expert, and every expert quantized without calibration."""
    lines = ["", "## Mixture of experts", "", f"- expert calibration: `{moe['calibration']}`"]
    if "min_tokens" in moe:
        lines.append(f"- experts with fewer than {moe['min_tokens']} calibration tokens: quantized with "
                     f"`{moe['uncalibrated_method']}` (no calibration)")
    if "vllm_moe_kernel" in moe:
        kernel = moe["vllm_moe_kernel"]
        lines.append(f"- vLLM fused-MoE kernel: `{kernel}` ({moe['why']})" if kernel else
                     f"- vLLM: no fused-MoE kernel takes these experts ({moe['why']}); quantkit.load runs them")
    layers = moe.get("layers") or {}
    if layers:
        lines += ["", "| layer | experts | tokens per expert (min / median / max) | quantized without calibration |",
                  "|---|---|---|---|"]
        for name, r in layers.items():
            left = ", ".join(f"`{n}`" for n in r["uncalibrated"]) or "none"
            lines.append(f"| `{name}` | {r['num_experts']} | {r['tokens_min']} / {r['tokens_median']} / "
                         f"{r['tokens_max']} | {left} |")
    lines += ["", f"Per-expert counts: `{MOE_REPORT}`. Experts are stored per expert (`experts.{{e}}.<projection>`); "
              "transformers loads them from compressed-tensors only (its gptq and awq integrations have no "
              "per-expert path) and quantkit.load from every layout; the vLLM kernel above is read from vLLM's "
              "code, not loaded in a test (docs/support-matrix.md).", ""]
    return "\n".join(lines)


def _notice_vllm_refusal(format_name: str, specs: dict[str, LinearSpec]) -> None:
    """Say at write time, not only in the card, when the support matrix knows vLLM refuses the layout."""
    from quantkit.formats.loaders import VLLM, vllm_refusal
    from quantkit.notices import notice

    refusal = vllm_refusal(format_name, specs) if format_name != "gguf" else None
    if refusal:
        notice(f"quantkit: {VLLM} will not load this checkpoint: {refusal}")


def append_card_metrics(folder: Path, metrics: dict[str, Any], model_index: Optional[dict[str, Any]] = None) -> None:
    """Add a "Measured" section to an existing model card (atomic replace); `model_index`
    ({"dataset": name, "metrics": [(type, name, value), ...]}) also goes into its Hub metadata."""
    card = folder / "README.md"
    text = card.read_text().rstrip("\n") + "\n\n## Measured\n\n" + "".join(f"- {k}: {v}\n" for k, v in metrics.items())
    if model_index is not None:
        text = with_model_index(text, folder.name, model_index["dataset"], model_index["metrics"])
    tmp = card.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, card)


def _activations_line(specs: dict[str, LinearSpec]) -> str:
    kinds = {"token": "int8 dynamic per token", "tensor": "int8 static per tensor (input_scale)"}
    found = sorted({kinds[s.input_quant] for s in specs.values() if s.input_quant})
    return ", ".join(found) + " (W8A8)" if found else "full precision (weight-only)"


def _provenance_line(source: str, base_model: str, repacked: bool) -> str:
    if not repacked:
        return f"Quantized from {source} with quantkit {__version__}."
    base = repacked_base(base_model)
    of = f", a quantized checkpoint of [{base}](https://huggingface.co/{base})" if base else ""
    return f"Re-packed by `quantkit convert` (every weight unchanged) from {source}{of}, with quantkit {__version__}."


def model_card(base_model: str, format_name: str, method: dict[str, Any], qcfg: dict, specs: dict[str, LinearSpec]) -> str:
    """The checkpoint's README; measured quality is appended later by `append_card_metrics`.
    `method["method"] == "convert"`: `base_model` is the quantized folder that was re-packed."""
    from quantkit.formats.loaders import loaders_checked

    bits = sorted({s.bits for s in specs.values()})
    groups = sorted({s.group_size for s in specs.values()})
    tags = ["quantkit", method.get("method", "quantized"), format_name] + [f"{b}-bit" for b in bits]
    repacked = method.get("method") == "convert"
    library = "gguf" if format_name == "gguf" else "transformers"
    front = [render_front_matter(front_matter(base_model, tags, method.get("calibration"), library=library,
                                              repacked=repacked)).rstrip("\n")]
    source = f"[{base_model}](https://huggingface.co/{base_model})" if is_hub_id(base_model) else f"`{base_model}`"
    lines = [
        "",
        f"# {Path(base_model).name} — {method.get('method', '?').upper()} {'/'.join(map(str, bits))}-bit",
        "",
        _provenance_line(source, base_model, repacked),
        "",
        "## Quantization",
        "",
        f"- method: `{method.get('method')}`",
        f"- format: `{format_name}` (quant_method `{qcfg.get('quant_method')}`)",
        f"- bits: {', '.join(map(str, bits))}; group size: {', '.join('per-channel' if g == -1 else str(g) for g in groups)}",
        f"- symmetric: {sorted({s.sym for s in specs.values()})}",
        f"- activations: {_activations_line(specs)}",
        f"- quantized linears: {len(specs)}",
    ]
    kv = qcfg.get("kv_cache_scheme")
    if kv:  # --kv-cache-scheme: static FP8 scales vLLM uses with --kv-cache-dtype fp8
        lines.append(f"- KV cache: FP8 (e4m3) with calibrated static scales per {kv.get('strategy')} "
                     "(`k_scale` / `v_scale`; serve with `--kv-cache-dtype fp8`)")
    for k, v in method.items():
        if k != "method":
            lines.append(f"- {k}: `{v}`")
    lines += ["", "## Use", "", "```python", "import quantkit", "model = quantkit.load(\"PATH\")", "```", "",
              "Other loaders, as quantkit's support matrix (docs/support-matrix.md) found them for this layout:", ""]
    lines += [f"- {line}" for line in loaders_checked(format_name, specs)] + [""]
    return "\n".join(front + lines)
