"""A compressed-tensors quantization_config whose groups are float layouts, read into typed values.

The layout modules (`ct_float_quantized`, `ct_mxfp8`, `ct_nvfp4`, `ct_mxfp4`, and for integer weights under FP8
activations `ct_w4afp8` / `ct_int_w4afp8`, pack-quantized as quantkit writes it / int-quantized as llm-compressor
does) each store one linear; this module
reads the config around them: each config group's weights / input-activation args (compressed-tensors'
QuantizationArgs schema -> `QuantArgs`, validated), its layout, and which linears it targets and ignores,
matched as compressed-tensors matches them (`Linear` = every linear, ``re:`` a regex from the name's start,
anything else the exact module name).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

from quantkit.errors import QuantkitError
from quantkit.formats import ct_float_quantized, ct_int_w4afp8, ct_mxfp4, ct_mxfp8, ct_nvfp4, ct_w4afp8
from quantkit.scheme_presets import QuantArgs

LAYOUTS: dict[str, ModuleType] = {m.FORMAT: m for m in (ct_float_quantized, ct_mxfp8, ct_nvfp4, ct_mxfp4, ct_w4afp8,
                                                         ct_int_w4afp8)}
FLOAT_WEIGHT_FORMATS = (ct_float_quantized.FORMAT, ct_mxfp8.FORMAT, ct_nvfp4.FORMAT, ct_mxfp4.FORMAT)


@dataclass(frozen=True)
class FloatGroup:
    """One config group: the layout its weights are stored in and how its linears quantize."""

    name: str
    layout: ModuleType
    weights: QuantArgs
    input_activations: Optional[QuantArgs]
    targets: tuple[str, ...]


def args_from_config(d: dict) -> QuantArgs:
    """compressed-tensors' QuantizationArgs schema -> QuantArgs (validated, so nonsense is one line)."""
    if not isinstance(d, dict):
        raise QuantkitError(f"unreadable quantization args {d!r} in quantization_config; re-export the checkpoint")
    scale_dtype = d.get("scale_dtype")
    block = d.get("block_structure")
    dynamic = d.get("dynamic", False)
    try:
        return QuantArgs(kind=d["type"], bits=int(d["num_bits"]), strategy=d["strategy"],
                         group_size=d.get("group_size"), block_size=tuple(block) if block else None,
                         scale_dtype=str(scale_dtype).removeprefix("torch.") if scale_dtype else None,
                         dynamic=dynamic, symmetric=d.get("symmetric", True))
    except (KeyError, TypeError, ValueError) as exc:
        raise QuantkitError(f"unreadable quantization args in quantization_config ({exc}); re-export the "
                            "checkpoint") from None


def is_float_config(qcfg: dict) -> bool:
    """Whether a compressed-tensors quantization_config stores any group in a float layout, or quantizes a
    group's input activations to a float grid (W4AFP8: pack-quantized integer weights, FP8 inputs)."""
    if not isinstance(qcfg, dict):
        return False
    groups = qcfg.get("config_groups")
    groups = groups if isinstance(groups, dict) else {}  # malformed: the integer reader refuses it in one line
    groups = [g for g in groups.values() if isinstance(g, dict)]
    formats = {g.get("format") for g in groups} | {qcfg.get("format")}
    float_acts = any(isinstance(g.get("input_activations"), dict) and g["input_activations"].get("type") == "float"
                     for g in groups)
    return bool(formats & set(FLOAT_WEIGHT_FORMATS)) or float_acts


def float_groups(qcfg: dict) -> list[FloatGroup]:
    """Every config group, each checked to be a float layout that can store its own weights args."""
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantkitError("quantization_config has no config_groups")
    out = []
    for name, g in groups.items():
        if not isinstance(g, dict):
            raise QuantkitError(f"config group {name} is not an object")
        fmt = g.get("format") or qcfg.get("format")
        layout = LAYOUTS.get(fmt)
        if layout is None:
            raise QuantkitError(f"config group {name} has format {fmt!r}; quantkit reads mixed checkpoints only "
                                f"when every group is a float layout ({', '.join(LAYOUTS)})")
        weights = args_from_config(g.get("weights"))
        ok, reason = layout.can_store(weights)
        if not ok:
            raise QuantkitError(f"config group {name} disagrees with itself: {reason}")
        acts = g.get("input_activations")
        targets = g.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise QuantkitError(f"config group {name} needs a list of targets")
        out.append(FloatGroup(name, layout, weights, args_from_config(acts) if acts else None, tuple(targets)))
    return out


def matches(name: str, patterns, class_name: str = "Linear") -> bool:
    """compressed-tensors' target rule: the class name, ``re:<regex>`` (re.match), or the exact name."""
    for p in patterns or ():
        if p == class_name or p == name or (p.startswith("re:") and re.match(p[3:], name)):
            return True
    return False


def group_of(name: str, groups: list[FloatGroup], ignore) -> Optional[FloatGroup]:
    """The group that quantizes linear `name` (a checkpoint name), None when ignored or targeted by none."""
    if matches(name, ignore):
        return None
    return next((g for g in groups if matches(name, g.targets)), None)
