"""Writing a packed, Hub-ready checkpoint folder, atomically.

Everything goes into the run's hidden staging folder beside the destination (where the per-layer
progress already lives, see progress.py) and is renamed into place at the end, so an interrupted run never leaves a half-written output and never touches what the user
already had there. Tensors are packed by the format module (the same one the loader unpacks with).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch

from quantkit import __version__
from quantkit.errors import QuantkitError
from quantkit.formats import get_format
from quantkit.formats.spec import LinearSpec
from quantkit.progress import LAYER_DIR, RUN_FILE, ProgressStore


def staging_dir(output: Path) -> Path:
    return output.parent / f".{output.name}.partial"


def check_output_dir(output: Path, overwrite: bool) -> None:
    """Fail before any work if the destination would clobber the user's files or a leftover run exists."""
    if output.exists() and not output.is_dir():
        raise QuantkitError(f"output {output} exists and is not a folder; choose another --output")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise QuantkitError(f"output folder {output} is not empty; pass --overwrite or choose another --output")


def build_state_dict(model, store: ProgressStore, layers_prefix: str, format_name: str,
                     save_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, LinearSpec]]:
    """Unquantized tensors in `save_dtype`; each decoder layer from its progress record, with the
    quantized linears packed by the format module (the same one the loader unpacks with)."""
    fmt = get_format(format_name)
    state: dict[str, torch.Tensor] = {}
    specs: dict[str, LinearSpec] = {}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for key, tensor in model.state_dict().items():
        if key.startswith(layers_prefix + ".") or (tied and key == "lm_head.weight"):
            continue
        state[key] = _cast(tensor, save_dtype)
    for index in store.done_layers():
        record = store.load_layer(index)
        for name, qw in record.quantized.items():
            for suffix, tensor in fmt.pack(qw).items():
                state[f"{name}.{suffix}"] = tensor.contiguous()
            if qw.bias is not None:
                state[f"{name}.bias"] = qw.bias.to(torch.float16).contiguous()
            specs[name] = LinearSpec.of(qw)
        for key, tensor in record.other.items():
            state[key] = _cast(tensor, save_dtype)
    return state, specs


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
    metrics: Optional[dict[str, Any]] = None,
) -> Path:
    """Write the checkpoint into the run's staging folder, drop the progress files, rename into place."""
    output = Path(output)
    check_output_dir(output, overwrite)
    fmt = get_format(format_name)
    stage = store.folder
    for stale in [p for p in stage.iterdir() if p.name not in (LAYER_DIR, RUN_FILE)]:
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()  # a crash during an earlier final write
    state, specs = build_state_dict(model, store, layers_prefix, format_name, save_dtype)
    _save_sharded(state, stage, max_shard_size)
    del state
    qcfg = fmt.quantization_config(specs, ignore, format_extra)
    _save_config(model, stage, qcfg, save_dtype)
    if tokenizer is not None:
        tokenizer.save_pretrained(stage)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(stage)
        except (ValueError, OSError):
            pass
    (stage / "README.md").write_text(model_card(base_model, format_name, method, qcfg, specs, metrics))
    shutil.rmtree(stage / LAYER_DIR)
    (stage / RUN_FILE).unlink()
    _normal_permissions(stage)
    _replace_dir(stage, output)
    return output


def _save_sharded(state: dict[str, torch.Tensor], folder: Path, max_shard_size) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    try:
        split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size,
                                                   filename_pattern="model{suffix}.safetensors")
    except ValueError as exc:
        raise QuantkitError(f"invalid --max-shard-size {max_shard_size!r}: {exc}; use e.g. 2GB or 500MB") from None
    for filename, keys in split.filename_to_tensors.items():
        save_file({k: state[k] for k in keys}, str(folder / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _save_config(model, folder: Path, qcfg: dict, save_dtype: torch.dtype) -> None:
    config = model.config.to_diff_dict()
    for key in ("_name_or_path", "source_dtype", "transformers_version"):
        config.pop(key, None)
    config["quantization_config"] = qcfg
    config["dtype"] = str(save_dtype).replace("torch.", "")
    config.pop("torch_dtype", None)
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _normal_permissions(folder: Path) -> None:
    """Staged files may be created private (0600); a checkpoint is meant to be shared."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def _replace_dir(stage: Path, output: Path) -> None:
    """Rename the finished staging folder into place; an old output (with --overwrite) goes only after."""
    old = None
    if output.exists():
        old = output.parent / f".{output.name}.old-{os.getpid()}-{int(time.time())}"
        os.replace(output, old)
    os.replace(stage, output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def append_card_metrics(folder: Path, metrics: dict[str, Any]) -> None:
    """Add a "Measured" section to an existing model card (atomic replace)."""
    card = folder / "README.md"
    text = card.read_text().rstrip("\n") + "\n\n## Measured\n\n" + "".join(f"- {k}: {v}\n" for k, v in metrics.items())
    tmp = card.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, card)


def model_card(base_model: str, format_name: str, method: dict[str, Any], qcfg: dict, specs: dict[str, LinearSpec],
               metrics: Optional[dict[str, Any]]) -> str:
    bits = sorted({s.bits for s in specs.values()})
    groups = sorted({s.group_size for s in specs.values()})
    tags = ["quantkit", method.get("method", "quantized"), format_name] + [f"{b}-bit" for b in bits]
    front = ["---", f"base_model: {base_model}", "library_name: transformers", "pipeline_tag: text-generation", "tags:"]
    front += [f"- {t}" for t in dict.fromkeys(tags)]
    front.append("---")
    lines = [
        "",
        f"# {Path(base_model).name} — {method.get('method', '?').upper()} {'/'.join(map(str, bits))}-bit",
        "",
        f"Quantized from [{base_model}](https://huggingface.co/{base_model}) with quantkit {__version__}.",
        "",
        "## Quantization",
        "",
        f"- method: `{method.get('method')}`",
        f"- format: `{format_name}` (quant_method `{qcfg.get('quant_method')}`)",
        f"- bits: {', '.join(map(str, bits))}; group size: {', '.join('per-channel' if g == -1 else str(g) for g in groups)}",
        f"- symmetric: {sorted({s.sym for s in specs.values()})}",
        f"- quantized linears: {len(specs)}",
    ]
    for k, v in method.items():
        if k != "method":
            lines.append(f"- {k}: `{v}`")
    if metrics:
        lines += ["", "## Measured", ""]
        for k, v in metrics.items():
            lines.append(f"- {k}: {v}")
    lines += ["", "## Use", "", "```python", "import quantkit", "model = quantkit.load(\"PATH\")", "```", "",
              "The folder also loads with `transformers` (gptq/awq through their integrations, compressed-tensors "
              "through the `compressed-tensors` package) and with vLLM.", ""]
    return "\n".join(front + lines)
