"""compressed-tensors "pack-quantized" layout (llm-compressor's W{2..8}A16 output; vLLM's main format).

Checked against compressed-tensors 0.20.1 (`compressors/pack_quantized/`, `quantization/quant_args.py`):
    weight_packed     int32 [N, ceil(K*b/32)]   signed code + 2**(b-1) (= our unsigned code), dense
                                                LSB-first along the input dim (3-bit spans words)
    weight_scale      fp16  [N, G]              G = K/group_size, or 1 for strategy "channel"
    weight_zero_point int32 [ceil(N*b/32), G]   asymmetric only: signed zero + 2**(b-1) (= our zero),
                                                packed along the *output* dim (dim 0)
    weight_shape      int64 [2]                 [N, K]
Symmetric files carry no zero point: the zero is implicitly 2**(b-1) in our unsigned convention.
Dynamic act-order (a real g_idx, actorder "group") was removed from compressed-tensors 0.20;
only static act-order ("weight"), whose groups stay contiguous, can be written.
"""
from __future__ import annotations

import re
from collections import Counter

import torch

from quantkit.errors import QuantkitError
from quantkit.formats import bitpack, checks
from quantkit.formats.spec import LinearSpec
from quantkit.qtensor import QuantizedWeight

NAME = "compressed-tensors"
FORMAT = "pack-quantized"
# The compressed-tensors release whose layout and config schema this module follows; written as
# the config's "version" so a file does not depend on what happens to be installed.
CT_VERSION = "0.20.1"

_DYNAMIC_ERROR = ("compressed-tensors cannot store dynamic act-order (a permuted g_idx; actorder 'group' "
                  "was removed in compressed-tensors 0.20): use the gptq format, or static_groups/"
                  "static act-order")


def _check_spec(spec: LinearSpec) -> None:
    if not 2 <= spec.bits <= 8:
        raise QuantkitError(f"compressed-tensors pack-quantized stores 2..8-bit weights, not {spec.bits}-bit")
    if spec.act_order == "dynamic":
        raise QuantkitError(_DYNAMIC_ERROR)
    if spec.group_size != -1 and spec.in_features % spec.group_size:
        raise QuantkitError(f"compressed-tensors: group_size {spec.group_size} must divide "
                            f"in_features {spec.in_features}")


def packed_shapes(spec: LinearSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    _check_spec(spec)
    n, k, b, g = spec.out_features, spec.in_features, spec.bits, spec.n_groups
    shapes = {
        "weight_packed": ((n, bitpack.packed_length(k, b)), torch.int32),
        "weight_scale": ((n, g), torch.float16),
        "weight_shape": ((2,), torch.int64),
    }
    if not spec.sym:
        shapes["weight_zero_point"] = ((bitpack.packed_length(n, b), g), torch.int32)
    return shapes


def default_tensors(spec: LinearSpec) -> dict[str, torch.Tensor]:
    """Tensors a checkpoint may omit (weight_shape is implied by the model's linear)."""
    return {"weight_shape": torch.tensor([spec.out_features, spec.in_features], dtype=torch.int64)}


def pack(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    spec = checks.quantized_weight(qw, NAME)
    _check_spec(spec)
    out = {
        "weight_packed": bitpack.pack(qw.qweight, spec.bits, dim=1),
        "weight_scale": checks.fp16_scales(qw.scales, NAME).contiguous(),
        "weight_shape": torch.tensor([spec.out_features, spec.in_features], dtype=torch.int64),
    }
    mid = 1 << (spec.bits - 1)
    if spec.sym:
        if not bool((qw.zeros == mid).all()):
            raise QuantkitError(f"compressed-tensors: a symmetric weight must have every zero at {mid}")
    else:
        out["weight_zero_point"] = bitpack.pack(qw.zeros, spec.bits, dim=0)
    return out


def unpack(tensors: dict[str, torch.Tensor], spec: LinearSpec) -> QuantizedWeight:
    shapes = packed_shapes(spec)
    n, k, b, g = spec.out_features, spec.in_features, spec.bits, spec.n_groups
    packed = checks.tensor(tensors, "weight_packed", shapes["weight_packed"][0], (torch.int32,), NAME)
    scale = checks.tensor(tensors, "weight_scale", shapes["weight_scale"][0], checks.FLOAT_DTYPES, NAME)
    if "weight_shape" in tensors:
        shape = checks.tensor(tensors, "weight_shape", (2,), checks.INDEX_DTYPES, NAME)
        if shape.tolist() != [n, k]:
            raise QuantkitError(f"{NAME}: tensor 'weight_shape' is {shape.tolist()}, expected {[n, k]}")
    if spec.sym:
        if "weight_zero_point" in tensors:
            raise QuantkitError(f"{NAME}: unexpected tensor 'weight_zero_point' for a symmetric scheme")
        zeros = torch.full((n, g), 1 << (b - 1), dtype=torch.int32)
    else:
        zp = checks.tensor(tensors, "weight_zero_point", shapes["weight_zero_point"][0], (torch.int32,), NAME)
        zeros = bitpack.unpack(zp.cpu(), b, n, dim=0).to(torch.int32)
    return QuantizedWeight(
        qweight=bitpack.unpack(packed.cpu(), b, k, dim=1),
        scales=scale.cpu().float().contiguous(),
        zeros=zeros.contiguous(),
        g_idx=spec.trivial_g_idx(),
        bits=b,
        group_size=spec.group_size,
        sym=spec.sym,
        act_order=spec.act_order,
    )


# ---------------------------------------------------------------- config.json

def _scheme(spec: LinearSpec, targets: list[str]) -> dict:
    return {
        "targets": targets,
        "weights": {
            "num_bits": spec.bits,
            "type": "int",
            "symmetric": spec.sym,
            "strategy": "channel" if spec.group_size == -1 else "group",
            "group_size": None if spec.group_size == -1 else spec.group_size,
            "actorder": "weight" if spec.act_order == "static" else None,
            "dynamic": False,
            "observer": "minmax",
        },
        "input_activations": None,
        "output_activations": None,
        "format": FORMAT,
    }


def quantization_config(spec_by_module: dict[str, LinearSpec], ignore: list[str], extra: dict) -> dict:
    """Config for config.json. The commonest scheme targets class "Linear"; other schemes target exact
    module names, which compressed-tensors' matcher ranks above class targets."""
    if not spec_by_module:
        raise QuantkitError("compressed-tensors: no quantized modules to describe")
    for spec in spec_by_module.values():
        _check_spec(spec)
    ranked = [s for s, _ in Counter(s.scheme() for s in spec_by_module.values()).most_common()]
    example = {s.scheme(): s for s in spec_by_module.values()}
    groups = {"group_0": _scheme(example[ranked[0]], ["Linear"])}
    for i, scheme in enumerate(ranked[1:], start=1):
        names = [m for m, s in spec_by_module.items() if s.scheme() == scheme]
        groups[f"group_{i}"] = _scheme(example[scheme], names)
    extra = dict(extra or {})
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "version": extra.pop("version", CT_VERSION),
        "config_groups": groups,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        **extra,
    }


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' match_name, plus the class target "Linear" (every name we are given is one)."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target == "Linear"


def _rank(target: str) -> tuple:
    # compressed-tensors' precedence: exact names, then regexes (sorted), then class names
    return (0 if not target.startswith("re:") and target != "Linear" else 1 if target.startswith("re:") else 2,
            target)


def _parse_weights(group_name: str, group: dict, top_format: str) -> dict:
    if not isinstance(group, dict):
        raise QuantkitError(f"compressed-tensors: config group {group_name!r} is a preset name; "
                            "only explicit schemes are supported")
    fmt = group.get("format") or top_format
    if fmt != FORMAT:
        raise QuantkitError(f"compressed-tensors: format {fmt!r} (group {group_name!r}) is not supported, "
                            f"only {FORMAT!r}")
    if group.get("input_activations") or group.get("output_activations"):
        raise QuantkitError(f"compressed-tensors: group {group_name!r} quantizes activations; "
                            "only weight-only schemes are supported")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise QuantkitError(f"compressed-tensors: group {group_name!r} has no weight scheme")
    if str(w.get("type", "int")).lower() != "int" or w.get("dynamic", False):
        raise QuantkitError(f"compressed-tensors: group {group_name!r} weights must be static int")
    strategy = str(w.get("strategy") or ("channel" if w.get("group_size") == -1 else "group")).lower()
    if strategy == "channel":
        group_size = -1
    elif strategy == "group" and isinstance(w.get("group_size"), int) and w["group_size"] > 0:
        group_size = w["group_size"]
    else:
        raise QuantkitError(f"compressed-tensors: group {group_name!r} strategy {strategy!r} "
                            f"(group_size {w.get('group_size')!r}) is not supported; use group or channel")
    actorder = w.get("actorder")
    if actorder is True or str(actorder).lower() in ("group", "dynamic"):
        raise QuantkitError(_DYNAMIC_ERROR)
    if actorder not in (None, False) and str(actorder).lower() not in ("weight", "static"):
        raise QuantkitError(f"compressed-tensors: unknown actorder {actorder!r}")
    return {"bits": int(w.get("num_bits", 8)), "group_size": group_size, "sym": bool(w.get("symmetric", True)),
            "act_order": "static" if actorder not in (None, False) else "none"}


def parse_quantization_config(qcfg: dict, linear_names: list[str],
                              linear_shapes: dict[str, tuple[int, int]]) -> dict[str, LinearSpec]:
    if qcfg.get("quant_method") != "compressed-tensors":
        raise QuantkitError(f"compressed-tensors: quant_method is {qcfg.get('quant_method')!r}, "
                            "expected 'compressed-tensors'")
    status = qcfg.get("quantization_status", "compressed")
    if status != "compressed":
        raise QuantkitError(f"compressed-tensors: quantization_status {status!r} is not supported "
                            "(only 'compressed' checkpoints hold packed weights)")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qcfg.get(key):
            raise QuantkitError(f"compressed-tensors: {key} is not supported")
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantkitError("compressed-tensors: quantization_config has no config_groups")
    top_format = qcfg.get("format") or FORMAT
    by_target: dict[str, dict] = {}
    for group_name, group in groups.items():
        weights = _parse_weights(group_name, group, top_format)
        for target in group.get("targets") or []:
            by_target[target] = weights  # as in compressed-tensors: a later group wins a shared target
    ignore = list(qcfg.get("ignore") or [])
    targets = sorted(by_target, key=_rank)
    out: dict[str, LinearSpec] = {}
    for name in linear_names:
        if any(_matches(name, ign) for ign in ignore):
            continue
        match = next((t for t in targets if _matches(name, t)), None)
        if match is None:
            continue
        out_f, in_f = linear_shapes[name]
        spec = LinearSpec(out_features=out_f, in_features=in_f, **by_target[match])
        _check_spec(spec)
        out[name] = spec
    return out
