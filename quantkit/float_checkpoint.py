"""Round-to-nearest quantization of a model's linears onto a float preset, written as a compressed-tensors
checkpoint (#47 foundation; not yet reachable from the CLI, see docs/float-schemes.md).

Only presets whose activations need no calibration are written: weight-only (NVFP4A16, MXFP4A16) and
dynamic-activation ones (FP8_DYNAMIC, FP8_BLOCK, MXFP4).  FP8 (static per-tensor input scale) and NVFP4
(calibrated input global scale) need activation statistics, which this path does not gather yet.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import torch

from quantkit.errors import QuantkitError
from quantkit.float_codecs import fp8, mxfp4, nvfp4
from quantkit.formats import ct_float_quantized, ct_mxfp4, ct_nvfp4
from quantkit.scheme_presets import QuantArgs, SchemePreset

_LAYOUTS = {m.FORMAT: m for m in (ct_float_quantized, ct_nvfp4, ct_mxfp4)}

CT_VERSION = "0.20.1"  # the compressed-tensors release whose config schema this follows
WRITABLE = ("FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "MXFP4A16", "MXFP4")
DEFAULT_IGNORE = (r"(^|\.)lm_head$",)


def layout_of(preset: SchemePreset) -> str:
    """The compressed-tensors format that stores this preset's weights."""
    if preset.name not in WRITABLE:
        raise QuantkitError(f"--scheme {preset.name} cannot be written by round-to-nearest yet (it needs "
                            "calibrated activation scales or is an integer scheme); "
                            f"choose one of {', '.join(WRITABLE)}")
    for layout in (ct_float_quantized, ct_nvfp4, ct_mxfp4):
        if layout.can_store(preset.weights)[0]:
            return layout.FORMAT
    raise QuantkitError(f"no compressed-tensors float layout stores --scheme {preset.name}'s weights")


def quantize_weight(weight: torch.Tensor, preset: SchemePreset) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(tensors to store, the float32 weight they dequantize to) for one linear's weight."""
    layout = layout_of(preset)
    w = preset.weights
    if layout == ct_float_quantized.FORMAT:
        q = fp8.quantize(weight, w.strategy, w.block_size)
        return ct_float_quantized.pack(q), q.dequantize()
    if layout == ct_nvfp4.FORMAT:
        q = nvfp4.quantize(weight)
        return ct_nvfp4.pack(q), q.dequantize()
    q = mxfp4.quantize(weight)
    return ct_mxfp4.pack(q), q.dequantize()


def _args_config(a: QuantArgs) -> dict:
    """QuantArgs in compressed-tensors' QuantizationArgs schema (config.json)."""
    return {
        "num_bits": a.bits, "type": a.kind, "symmetric": a.symmetric, "group_size": a.group_size,
        "strategy": a.strategy, "block_structure": list(a.block_size) if a.block_size else None,
        "dynamic": a.dynamic, "actorder": None, "observer": None,
        "scale_dtype": f"torch.{a.scale_dtype}" if a.scale_dtype else None,
        "zp_dtype": f"torch.{a.scale_dtype}" if a.scale_dtype else None,
    }


def quantization_config(preset: SchemePreset, ignore: Iterable[str]) -> dict:
    """config.json "quantization_config": one group targeting every Linear, `ignore` exact module names."""
    layout = layout_of(preset)
    group = {"targets": ["Linear"], "weights": _args_config(preset.weights),
             "input_activations": _args_config(preset.input_activations) if preset.input_activations else None,
             "output_activations": None, "format": layout}
    return {"quant_method": "compressed-tensors", "format": layout, "quantization_status": "compressed",
            "version": CT_VERSION, "config_groups": {"group_0": group}, "ignore": sorted(ignore),
            "kv_cache_scheme": None, "global_compression_ratio": None, "sparsity_config": {},
            "transform_config": {}}


def write(model: torch.nn.Module, preset: SchemePreset, output: os.PathLike,
          ignore: Iterable[str] = DEFAULT_IGNORE) -> dict[str, torch.Tensor]:
    """Quantize every nn.Linear of a transformers model not matching `ignore` (regexes) and save it to `output`
    (a new folder; written in a staging folder beside it and renamed, so a failure leaves nothing behind).
    Returns {module name: dequantized float32 weight}, what a reader should reconstruct."""
    from safetensors.torch import save_file

    out = Path(output)
    if out.exists():
        raise QuantkitError(f"output folder {out} already exists; choose a new folder")
    layout_of(preset)
    patterns = tuple(ignore)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    dequantized, skipped = {}, []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if any(re.search(p, name) for p in patterns):
            skipped.append(name)
            continue
        tensors, dequantized[name] = quantize_weight(module.weight.detach(), preset)
        del state[f"{name}.weight"]
        state.update({f"{name}.{suffix}": t for suffix, t in tensors.items()})
    if not dequantized:
        raise QuantkitError("no linear layers left to quantize after the ignore list; loosen --ignore")
    # tied parameters share storage; safetensors refuses shared tensors, so store independent copies
    seen = set()
    for key, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            state[key] = tensor.clone()
        seen.add(ptr)
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config(preset, skipped)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2, default=str))
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dequantized


def _args_from_config(d: dict) -> QuantArgs:
    """compressed-tensors' QuantizationArgs schema -> QuantArgs (validated, so nonsense is one line)."""
    scale_dtype = d.get("scale_dtype")
    block = d.get("block_structure")
    try:
        return QuantArgs(kind=d["type"], bits=int(d["num_bits"]), strategy=d["strategy"],
                         group_size=d.get("group_size"), block_size=tuple(block) if block else None,
                         scale_dtype=str(scale_dtype).removeprefix("torch.") if scale_dtype else None,
                         dynamic=d.get("dynamic", False), symmetric=d.get("symmetric", True))
    except (KeyError, TypeError, ValueError) as exc:
        raise QuantkitError(f"unreadable weights entry in quantization_config ({exc}); re-export the checkpoint")


def read_dequantized(folder: os.PathLike) -> dict[str, torch.Tensor]:
    """{module name: float32 weight} of a single-group compressed-tensors float checkpoint in `folder`
    (float-quantized, nvfp4-pack-quantized or mxfp4-pack-quantized), reading only that folder's
    *.safetensors files (no pickle)."""
    from safetensors.torch import load_file

    root = Path(folder)
    try:
        qcfg = json.loads((root / "config.json").read_text())["quantization_config"]
    except (OSError, ValueError, KeyError) as exc:
        raise QuantkitError(f"{root} has no readable config.json with a quantization_config ({exc})") from None
    groups = list((qcfg.get("config_groups") or {}).values())
    if qcfg.get("quant_method") != "compressed-tensors" or len(groups) != 1:
        raise QuantkitError("only single-group compressed-tensors float checkpoints are read yet")
    layout = _LAYOUTS.get(groups[0].get("format") or qcfg.get("format"))
    if layout is None:
        raise QuantkitError(f"format {qcfg.get('format')!r} is not a compressed-tensors float layout; "
                            f"expected one of {', '.join(_LAYOUTS)}")
    weights = _args_from_config(groups[0].get("weights") or {})
    ok, reason = layout.can_store(weights)
    if not ok:
        raise QuantkitError(f"quantization_config disagrees with itself: {reason}")
    tensors = {}
    for path in sorted(root.glob("*.safetensors")):
        try:
            tensors.update(load_file(str(path)))
        except Exception as exc:  # safetensors raises its own error type for a damaged file
            raise QuantkitError(f"cannot read {path.name}: {str(exc).splitlines()[0] if str(exc) else exc!r}; "
                                "the file is damaged, re-download or re-export it") from None
    marker = "weight_packed" if layout is not ct_float_quantized else "weight_scale"
    modules = sorted(k[: -len(marker) - 1] for k in tensors if k.endswith("." + marker))
    out = {}
    for name in modules:
        own = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        if layout is ct_float_quantized:
            if "weight" not in own:
                raise QuantkitError(f"{name} has a weight_scale but no weight; the checkpoint is incomplete")
            q = layout.unpack(own, tuple(own["weight"].shape), weights.strategy, weights.block_size)
        else:
            packed = own["weight_packed"]
            q = layout.unpack(own, (packed.shape[0], packed.shape[1] * 2))
        out[name] = q.dequantize()
    if not out:
        raise QuantkitError(f"{root} holds no {layout.FORMAT} tensors; the checkpoint does not match its config")
    return out
