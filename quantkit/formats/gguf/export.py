"""Assembling a GGUF checkpoint folder: `<output>/model.gguf` plus config.json, tokenizer and card.

It uses the quantizers (llama.cpp's rounding rule) and the checkpoint writer's folder handling, both of
which import `quantkit.formats`, so those two imports are made where they are used, not at module level:
each planned tensor comes from a quantizer's result when quantkit calibrated it, is rounded onto
its type's grid by llama.cpp's own rule when it was not (the token embedding, an ignored linear),
and stays float where the plan says F32/F16/BF16. Written into the run's staging folder and renamed
into place, like every other checkpoint (checkpoint.py).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from quantkit.errors import QuantkitError
from quantkit.finite import require_finite
from quantkit.formats.gguf import file_io as gguf_format
from quantkit.formats.spec import LinearSpec
from quantkit.formats.gguf.types import MIXES, check_gguf_type
from quantkit.formats.gguf.plan import PlannedTensor, plan_model
from quantkit.qtensor import QuantizedWeight
from quantkit.scheme import LinearScheme

Value = Union[QuantizedWeight, torch.Tensor]


def default_gguf_type(bits: int, sym: bool) -> str:
    """The llama.cpp type matching a quantkit scheme: 4-bit sym Q4_0, asym Q4_1, 8-bit Q8_0."""
    if bits == 4:
        return "Q4_0" if sym else "Q4_1"
    if bits == 8 and sym:
        return "Q8_0"
    raise QuantkitError(f"no GGUF type matches {bits}-bit {'sym' if sym else 'asym'}; pass --gguf-type "
                        "(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, Q4_K_M, Q5_K_M, F16, BF16, F32)")


def linear_schemes(model, gguf_type: str, targets: dict[str, LinearScheme],
                   calibrated: bool = False) -> dict[str, LinearScheme]:
    """Each target linear's scheme on the grid of the type llama-quantize would give it (`calibrated`:
    with an importance matrix); linears whose planned type is float (F16 fallback, a float file) are
    left out (not quantized)."""
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    planned = {p.hf_name: p for p in plan_model(shapes, model.config, gguf_type, calibrated)}
    out = {}
    for name in targets:
        p = planned.get(f"{name}.weight")
        if p is not None and p.type.quantized:
            out[name] = LinearScheme(bits=p.type.bits, group_size=p.type.group, sym=p.type.zero is not None,
                                     grid=p.type.name)
    return out


def to_planned(p: PlannedTensor, value: Value) -> Value:
    """A float tensor planned as a quantized type is rounded onto it (llama.cpp's rule)."""
    if p.type.quantized and not isinstance(value, QuantizedWeight):
        require_finite(p.hf_name, value)
        from quantkit.quantizers.gguf_grid import rtn_on_grid

        return rtn_on_grid(value.float(), p.type)
    return value


def write_gguf_folder(output: Path, stage: Path, model, tokenizer, gguf_type: str, fetch: Callable[[str], Value],
                      base_model: str, method: dict[str, Any], remove: tuple[str, ...] = (),
                      overwrite: bool = False, plan: Optional[list[PlannedTensor]] = None,
                      calibrated: bool = False) -> Path:
    """Write model.gguf (tensors from `fetch(hf_name)`), config.json, tokenizer and card into `stage`,
    drop `remove` (progress files), rename `stage` to `output`. `plan` defaults to llama-quantize's
    choices for `gguf_type` (`calibrated`: with an importance matrix, as `linear_schemes` chose)."""
    from quantkit.checkpoint import check_output_dir, model_card, normal_permissions, replace_dir

    output = Path(output)
    check_output_dir(output, overwrite)
    gguf_type = check_gguf_type(gguf_type)
    if plan is None:
        plan = plan_model({k: tuple(v.shape) for k, v in model.state_dict().items()}, model.config, gguf_type,
                          calibrated)
    stage.mkdir(parents=True, exist_ok=True)
    target = stage / gguf_format.FILENAME
    try:
        gguf_format.write_gguf(target, model.config, tokenizer, gguf_type,
                               [(p, (lambda p=p: to_planned(p, fetch(p.hf_name)))) for p in plan],
                               name=Path(base_model).name)
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    qcfg = {"quant_method": "gguf", "gguf_file": gguf_format.FILENAME, "gguf_type": gguf_type,
            "tensor_types": _type_counts(plan)}
    config = model.config.to_diff_dict()
    for key in ("_name_or_path", "source_dtype", "transformers_version", "torch_dtype"):
        config.pop(key, None)
    config["quantization_config"] = qcfg
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    (stage / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(stage)
    specs = _specs(plan)
    card = model_card(base_model, "gguf", method, qcfg, specs) + _gguf_card(plan, gguf_type, calibrated)
    (stage / "README.md").write_text(card)
    for name in remove:
        path = stage / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    normal_permissions(stage)
    replace_dir(stage, output)
    return output


def _type_counts(plan: list[PlannedTensor]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in plan:
        counts[p.type.name] = counts.get(p.type.name, 0) + 1
    return dict(sorted(counts.items()))


def _specs(plan: list[PlannedTensor]) -> dict[str, LinearSpec]:
    return {p.gguf_name: LinearSpec(p.shape[0], p.shape[1], p.type.bits, p.type.group, p.type.zero is not None)
            for p in plan if p.type.quantized and len(p.shape) == 2}


def _gguf_card(plan: list[PlannedTensor], gguf_type: str, calibrated: bool) -> str:
    total = sum(p.type.row_bytes(p.shape[-1]) * (p.shape[0] if len(p.shape) == 2 else 1) for p in plan)
    weights = sum(p.shape[0] * p.shape[-1] if len(p.shape) == 2 else p.shape[0] for p in plan)
    lines = ["", "## GGUF", "", f"- file: `{gguf_format.FILENAME}` (llama.cpp), type {gguf_type}"
             + (f" (mix; default tensor type {MIXES[gguf_type]})" if gguf_type in MIXES else ""),
             f"- tensor types: {', '.join(f'{k} x{v}' for k, v in _type_counts(plan).items())}",
             f"- {8 * total / weights:.3f} bits per weight over all tensors",
             *(["- tensor types and block scales as llama-quantize chooses them with an importance matrix "
                "(the calibration's per-column mean squared activation)"] if calibrated else []),
             "", "Run it with `llama-cli -m model.gguf` or `llama_cpp.Llama(model_path=...)`.", ""]
    return "\n".join(lines)


def float_type_of(dtype: torch.dtype) -> str:
    return {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}.get(dtype, "F32")



def record_fetch(model, store, layers_prefix: str) -> Callable[[str], Value]:
    """Tensors by HF name from a quantize run: decoder layers from their progress records (one
    record in memory at a time), everything else from the model."""
    state = model.state_dict()
    cache: dict[int, Any] = {}

    def fetch(name: str) -> Value:
        if not name.startswith(layers_prefix + "."):
            return state[name].detach()
        index = int(name[len(layers_prefix) + 1:].split(".", 1)[0])
        if index not in cache:
            cache.clear()
            cache[index] = store.load_layer(index)
        record = cache[index]
        module = name.rsplit(".", 1)[0]
        if module in record.quantized:
            return record.quantized[module]
        if name not in record.other:
            raise QuantkitError(f"internal: layer record {index} lacks {name}")
        return record.other[name]

    return fetch
