"""compressed-tensors layouts: "pack-quantized" (weight-only W{2..8}A16) and "int-quantized" (W8A8).

The layout follows the scheme: a QuantizedWeight with `input_quant` (int8 activations) is written
int-quantized, anything else pack-quantized; reading goes by each config group's format.

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

int-quantized (W8A8, what vLLM's CompressedTensorsW8A8Int8 reads), 8-bit symmetric per channel only:
    weight            int8  [N, K]   signed code (= our unsigned code - 128)
    weight_scale      fp16  [N, 1]
    input_scale       fp16  [1]      static per-tensor activations only
input_activations: {int 8, symmetric, strategy "token", dynamic true} or {..., "tensor", dynamic false}.
"""
from __future__ import annotations

import re
from collections import Counter

import torch

from quantkit.errors import QuantkitError
from quantkit.formats import bitpack, checks, registry
from quantkit.formats.spec import LinearSpec
from quantkit.qtensor import QuantizedWeight

NAME = "compressed-tensors"
FORMAT = "pack-quantized"
INT_FORMAT = "int-quantized"  # W8A8; "naive-quantized" is the same layout and is read too
MIXED_FORMAT = "mixed-precision"  # compressed-tensors' top-level format when groups differ
ACTIVATION_STRATEGIES = ("token", "tensor")  # what the writer can store (the API checks this)
# The compressed-tensors release whose layout and config schema this module follows; written as
# the config's "version" so a file does not depend on what happens to be installed.
CT_VERSION = "0.20.1"

_DYNAMIC_ERROR = registry.CT_DYNAMIC_ACT_ORDER


def _check_spec(spec: LinearSpec) -> None:
    """The scheme as `registry.CompressedTensorsFormat` declares it, then this linear's shape."""
    if not 2 <= spec.bits <= 8:
        raise QuantkitError(f"compressed-tensors pack-quantized stores 2..8-bit weights, not {spec.bits}-bit")
    registry.refuse_unless_stored(NAME, spec)
    if spec.input_quant is not None:
        return
    if spec.group_size != -1 and spec.in_features % spec.group_size:
        raise QuantkitError(f"compressed-tensors: group_size {spec.group_size} must divide "
                            f"in_features {spec.in_features}")


def packed_shapes(spec: LinearSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    _check_spec(spec)
    if spec.input_quant is not None:
        shapes = {"weight": ((spec.out_features, spec.in_features), torch.int8),
                  "weight_scale": ((spec.out_features, 1), torch.float16)}
        if spec.input_quant == "tensor":
            shapes["input_scale"] = ((1,), torch.float16)
        return shapes
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
    if spec.input_quant is not None:
        return {}
    return {"weight_shape": torch.tensor([spec.out_features, spec.in_features], dtype=torch.int64)}


def pack(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    spec = checks.quantized_weight(qw, NAME)
    _check_spec(spec)
    if spec.input_quant is not None:
        return _pack_int(qw, spec)
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
    if spec.input_quant is not None:
        return _unpack_int(tensors, spec, shapes)
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


def _pack_int(qw: QuantizedWeight, spec: LinearSpec) -> dict[str, torch.Tensor]:
    try:
        codes = qw.signed_int8()
    except ValueError as e:
        raise QuantkitError(f"{NAME}: int-quantized weights: {e}") from None
    out = {"weight": codes,
           "weight_scale": checks.fp16_scales(qw.scales, NAME).reshape(spec.out_features, 1).contiguous()}
    iq = qw.input_quant
    if iq.get("strategy") != spec.input_quant or bool(iq.get("dynamic")) != (spec.input_quant == "token"):
        raise QuantkitError(f"{NAME}: input_quant {iq} is neither dynamic per-token nor static per-tensor")
    if spec.input_quant == "tensor":
        scale = iq.get("scale")
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or not bool(scale.float().gt(0).all()):
            raise QuantkitError(f"{NAME}: static activations need one positive input scale, got {scale!r}")
        out["input_scale"] = checks.fp16_scales(scale.detach().float().reshape(1).cpu(), NAME)
    return out


def _unpack_int(tensors: dict[str, torch.Tensor], spec: LinearSpec, shapes: dict) -> QuantizedWeight:
    n, k = spec.out_features, spec.in_features
    weight = checks.tensor(tensors, "weight", shapes["weight"][0], (torch.int8,), NAME)
    scale = checks.tensor(tensors, "weight_scale", shapes["weight_scale"][0], checks.FLOAT_DTYPES, NAME)
    iq = {"strategy": spec.input_quant, "dynamic": spec.input_quant == "token"}
    if spec.input_quant == "tensor":
        iscale = checks.tensor(tensors, "input_scale", shapes["input_scale"][0], checks.FLOAT_DTYPES, NAME)
        if not bool(iscale.float().gt(0).all()) or not bool(torch.isfinite(iscale.float()).all()):
            raise QuantkitError(f"{NAME}: 'input_scale' must be positive and finite")
        iq["scale"] = iscale.detach().cpu().float().reshape(1)
    return QuantizedWeight(
        qweight=(weight.cpu().to(torch.int16) + 128).to(torch.uint8),
        scales=scale.cpu().float().reshape(n, 1).contiguous(),
        zeros=torch.full((n, 1), 128, dtype=torch.int32),
        g_idx=torch.zeros(k, dtype=torch.int32),
        bits=8, group_size=-1, sym=True, input_quant=iq,
    )


# ---------------------------------------------------------------- config.json

def _scheme(spec: LinearSpec, targets: list[str]) -> dict:
    if spec.input_quant is not None:
        return _int_scheme(spec, targets)
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


def _int_scheme(spec: LinearSpec, targets: list[str]) -> dict:
    """llm-compressor's W8A8 preset (or its static variant), as vLLM's CompressedTensorsW8A8Int8 reads it."""
    dynamic = spec.input_quant == "token"
    return {
        "targets": targets,
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None,
                    "actorder": None, "dynamic": False, "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": spec.input_quant,
                              "group_size": None, "dynamic": dynamic, "observer": None if dynamic else "minmax"},
        "output_activations": None,
        "format": INT_FORMAT,
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
    formats = {g["format"] for g in groups.values()}
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else MIXED_FORMAT,
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
    if fmt in (INT_FORMAT, "naive-quantized"):
        return _parse_int_group(group_name, group)
    if fmt != FORMAT:
        raise QuantkitError(f"compressed-tensors: format {fmt!r} (group {group_name!r}) is not supported, "
                            f"only {FORMAT!r} and {INT_FORMAT!r}")
    if group.get("input_activations") or group.get("output_activations"):
        raise QuantkitError(f"compressed-tensors: group {group_name!r} quantizes activations in the {FORMAT} "
                            "layout; only weight-only pack-quantized schemes are supported")
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


def _parse_int_group(group_name: str, group: dict) -> dict:
    """An int-quantized group: 8-bit symmetric per-channel weights plus int8 token/tensor activations."""
    w, a = group.get("weights"), group.get("input_activations")
    if not isinstance(a, dict):
        raise QuantkitError(f"compressed-tensors: int-quantized group {group_name!r} has no input_activations; "
                            "only W8A8 int-quantized schemes are supported")
    if group.get("output_activations"):
        raise QuantkitError(f"compressed-tensors: group {group_name!r} quantizes output activations; unsupported")
    if not isinstance(w, dict) or (str(w.get("type", "int")).lower(), w.get("num_bits"), w.get("symmetric", True),
                                   str(w.get("strategy")).lower(), bool(w.get("dynamic", False))) != ("int", 8, True, "channel", False):
        raise QuantkitError(f"compressed-tensors: int-quantized group {group_name!r} weights must be static int8 "
                            f"symmetric per channel, got {w!r}")
    strategy = str(a.get("strategy")).lower()
    plain = (str(a.get("type", "int")).lower(), a.get("num_bits"), a.get("symmetric", True)) == ("int", 8, True)
    if not plain or (strategy, bool(a.get("dynamic"))) not in (("token", True), ("tensor", False)):
        raise QuantkitError(f"compressed-tensors: group {group_name!r} input activations must be int8 symmetric, "
                            f"dynamic per token or static per tensor; got {a!r}")
    return {"bits": 8, "group_size": -1, "sym": True, "act_order": "none", "input_quant": strategy}


def parse_quantization_config(qcfg: dict, linear_names: list[str],
                              linear_shapes: dict[str, tuple[int, int]]) -> dict[str, LinearSpec]:
    if qcfg.get("quant_method") != "compressed-tensors":
        raise QuantkitError(f"compressed-tensors: quant_method is {qcfg.get('quant_method')!r}, "
                            "expected 'compressed-tensors'")
    status = qcfg.get("quantization_status", "compressed")
    if status != "compressed":
        raise QuantkitError(f"compressed-tensors: quantization_status {status!r} is not supported "
                            "(only 'compressed' checkpoints hold packed weights)")
    # a kv_cache_scheme is read (and checked) by runtime.kv_scales.take_kv_scales, which every loader runs
    for key in ("sparsity_config", "transform_config"):
        if qcfg.get(key):
            raise QuantkitError(f"compressed-tensors: {key} is not supported")
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantkitError("compressed-tensors: quantization_config has no config_groups")
    top_format = qcfg.get("format") or FORMAT
    if top_format == MIXED_FORMAT:
        top_format = None  # every group then names its own format
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
