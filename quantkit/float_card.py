"""The model card (README.md) of a float-preset checkpoint (--scheme FP8_DYNAMIC, NVFP4A16, ...).

Why a card of its own: the integer card is built from per-linear LinearSpecs (bits, group size, zero
points); a float preset is one named compressed-tensors scheme for every linear, with an activation
grid, and the loaders that run it differ by preset (vLLM's CPU build refuses most FP4 / static FP8
layouts). vLLM's line comes from `formats.loaders.vllm_float_refusal`, the rule the vLLM test tier
holds to what vLLM does; measured quality is appended by `checkpoint.append_card_metrics` after
--eval, as for the integer card.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from quantkit import __version__
from quantkit.card_metadata import front_matter, is_hub_id, render_front_matter
from quantkit.scheme_presets import QuantArgs, SchemePreset

OTHER_LOADERS = ["compressed-tensors' decompressor gives quantkit's weights (tests/test_float_checkpoint.py)",
                 "quantkit.load: reference dequantization on CPU (tests/test_float_runtime.py)"]


def describe(args: QuantArgs, activations: bool = False) -> str:
    """One tensor role's grid in words: 'FP4 (E2M1), groups of 16 under a global scale, float8_e4m3fn scales';
    for input activations also whether their scales are computed at run time (dynamic) or stored."""
    grid = {("float", 8): "FP8 (E4M3)", ("float", 4): "FP4 (E2M1)"}.get((args.kind, args.bits), f"int{args.bits}")
    where = {"tensor": "per tensor", "channel": "per channel", "token": "per token",
             "group": f"groups of {args.group_size}", "tensor_group": f"groups of {args.group_size} under a global scale",
             "block": f"blocks of {args.block_size[0]}x{args.block_size[1]}" if args.block_size else "blocks"}
    parts = [grid, where.get(args.strategy, args.strategy)]
    if args.scale_dtype == "uint8":  # the MX formats' E8M0 byte: a biased exponent
        parts.append("E8M0 (power-of-two) scales")
    elif args.scale_dtype:
        parts.append(f"{args.scale_dtype} scales")
    if not args.symmetric:
        parts.append("asymmetric")
    if activations:
        parts.append("dynamic" if args.dynamic is True else f"dynamic ({args.dynamic})" if args.dynamic else
                     "static (scales calibrated)")
    return ", ".join(parts)


def float_model_card(base_model: str, preset: SchemePreset, method: dict[str, Any], qcfg: dict,
                     shapes: Mapping[str, tuple[int, int]]) -> str:
    """The card of a folder `quantkit.float_checkpoint.write` made from `base_model`; `method` is the plan's
    method name, the calibration it read and the options given (not every default of the integer steps);
    `shapes` {linear: (out, in)} of the quantized linears."""
    from quantkit.formats.loaders import VLLM, vllm_float_checked, vllm_float_refusal

    name = str(method.get("method", "rtn"))
    tags = ["quantkit", name, "compressed-tensors", preset.name.lower()]
    front = render_front_matter(front_matter(base_model, tags, method.get("calibration"))).rstrip("\n")
    source = f"[{base_model}](https://huggingface.co/{base_model})" if is_hub_id(base_model) else f"`{base_model}`"
    ignored = ", ".join(f"`{i}`" for i in qcfg.get("ignore") or []) or "none"
    activations = describe(preset.input_activations, activations=True) if preset.input_activations else "not quantized (16-bit)"
    lines = ["", f"# {Path(base_model).name} — {name.upper()} {preset.name}", "",
             f"Quantized from {source} with quantkit {__version__}.", "", "## Quantization", "",
             f"- method: `{name}`",
             f"- scheme: `{preset.name}` (format `{qcfg.get('format')}`, quant_method `{qcfg.get('quant_method')}`)",
             f"- weights: {describe(preset.weights)}",
             f"- input activations: {activations}",
             f"- quantized linears: {len(shapes)}; kept in full precision: {ignored}"]
    kv = qcfg.get("kv_cache_scheme")
    if kv:
        lines.append(f"- KV cache: FP8 (e4m3) with calibrated static scales per {kv.get('strategy')} "
                     "(`k_scale` / `v_scale`; serve with `--kv-cache-dtype fp8`)")
    lines += [f"- {k}: `{v}`" for k, v in method.items() if k != "method"]
    lines += ["", "## Use", "", "```python", "import quantkit", 'model = quantkit.load("PATH")', "```", "",
              "Loaders, as quantkit's support matrix (docs/support-matrix.md) found them for this preset:", ""]
    refusal = vllm_float_refusal(preset.name, shapes)
    if not vllm_float_checked(preset.name):
        served = f"{VLLM}: not checked for this preset (neither its CPU build nor its GPU kernels)"
    else:
        served = f"{VLLM}: " + (f"refuses it: {refusal}" if refusal else "loads the folder unmodified; prompt "
                                "log-probs checked against quantkit's loader (tests/test_vllm.py)")
    lines += [f"- {line}" for line in [served, *OTHER_LOADERS]] + [""]
    return "\n".join([front, *lines])
