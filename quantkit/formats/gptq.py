"""GPTQ v1 layout (checkpoint_format "gptq"), as AutoGPTQ/GPTQModel write it and vLLM reads it.

    qweight int32 [K*b/32, N]   codes packed along the input dim (dense LSB-first; 3-bit spans words)
    qzeros  int32 [G, N*b/32]   zero - 1 per value, packed along the output dim
    scales  fp16  [G, N]
    g_idx   int32 [K]           group of each input column (a permutation map with dynamic act-order)

v1's "zero - 1" cannot hold an asymmetric zero of 0; the stored field wraps to all ones
((0 - 1) & mask), which per-value v1 decoders ((field + 1) & mask: AutoGPTQ, vLLM) read back as 0.
GPTQModel instead converts v1 to v2 by adding 0x11111111 to the whole word, so there the wrap
carries into the next value's zero; `pack` warns when it writes such a zero.
"""
from __future__ import annotations

import math
import re
import warnings
from collections import Counter

import torch

from quantkit.errors import QuantkitError
from quantkit.formats import bitpack, checks, registry
from quantkit.formats.spec import LinearSpec
from quantkit.qtensor import QuantizedWeight

NAME = "gptq"
_DEFAULTS = {"true_sequential": True, "damp_percent": 0.01}


def _check_spec(spec: LinearSpec) -> None:
    """The scheme as `registry.GptqFormat` declares it, then this linear's shape."""
    registry.refuse_unless_stored(NAME, spec)
    for what, n in (("in_features", spec.in_features), ("out_features", spec.out_features)):
        if n * spec.bits % 32:
            raise QuantkitError(f"gptq {spec.bits}-bit needs {what} ({n}) to fill whole int32 words "
                                f"(a multiple of {32 // math.gcd(32, spec.bits)})")


def packed_shapes(spec: LinearSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    _check_spec(spec)
    k, n, b, g = spec.in_features, spec.out_features, spec.bits, spec.n_groups
    return {
        "qweight": ((k * b // 32, n), torch.int32),
        "qzeros": ((g, n * b // 32), torch.int32),
        "scales": ((g, n), torch.float16),
        "g_idx": ((k,), torch.int32),
    }


def default_tensors(spec: LinearSpec) -> dict[str, torch.Tensor]:
    """Tensors a checkpoint may omit: old v1 files without act-order carry no g_idx."""
    return {} if spec.act_order == "dynamic" else {"g_idx": spec.trivial_g_idx()}


def pack(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    spec = checks.quantized_weight(qw, NAME)
    _check_spec(spec)
    if not spec.sym and bool((qw.zeros == 0).any()):
        warnings.warn("gptq v1: an asymmetric zero of 0 is stored as (0-1)&mask; AutoGPTQ/vLLM read it "
                      "back exactly, GPTQModel's whole-word v1->v2 add carries into the next zero",
                      stacklevel=2)
    stored_zeros = (qw.zeros.t().to(torch.int64) - 1) & spec.max_code
    return {
        "qweight": bitpack.pack(qw.qweight.t(), spec.bits, dim=0),
        "qzeros": bitpack.pack(stored_zeros, spec.bits, dim=1),
        "scales": checks.fp16_scales(qw.scales.t().contiguous(), NAME),
        "g_idx": qw.g_idx.to(torch.int32).contiguous(),
    }


def unpack(tensors: dict[str, torch.Tensor], spec: LinearSpec) -> QuantizedWeight:
    shapes = packed_shapes(spec)
    k, n, b = spec.in_features, spec.out_features, spec.bits
    qweight = checks.tensor(tensors, "qweight", shapes["qweight"][0], (torch.int32,), NAME)
    qzeros = checks.tensor(tensors, "qzeros", shapes["qzeros"][0], (torch.int32,), NAME)
    scales = checks.tensor(tensors, "scales", shapes["scales"][0], checks.FLOAT_DTYPES, NAME)
    if "g_idx" in tensors:
        g = checks.tensor(tensors, "g_idx", shapes["g_idx"][0], checks.INDEX_DTYPES, NAME)
    elif spec.act_order == "dynamic":
        raise QuantkitError("gptq: missing tensor 'g_idx', required with desc_act and no static_groups")
    else:
        g = spec.trivial_g_idx()
    g = checks.g_idx(g, spec, NAME)
    codes = bitpack.unpack(qweight.cpu(), b, k, dim=0).t().contiguous()
    zeros = (bitpack.unpack(qzeros.cpu(), b, n, dim=1).to(torch.int32) + 1) & spec.max_code
    return QuantizedWeight(
        qweight=codes,
        scales=scales.cpu().float().t().contiguous(),
        zeros=zeros.t().contiguous(),
        g_idx=g,
        bits=b,
        group_size=spec.group_size,
        sym=spec.sym,
        act_order=spec.act_order,
    )


# ---------------------------------------------------------------- config.json

def _act_order_keys(act_order: str) -> dict:
    """The config keys that describe what is stored, which is what loaders act on.

    `desc_act` tells a loader that the g_idx permutes the groups, so it must reorder (vLLM 0.32 refuses
    such checkpoints outright). Act-order with static groups stores the trivial g_idx, so it is written
    `desc_act: false` like no act-order at all: vLLM, GPTQModel and transformers all load that. The
    processing order is kept for quantkit in its own key, `act_order`, which loaders ignore."""
    return {"desc_act": act_order == "dynamic", "static_groups": act_order == "static", "act_order": act_order}


def _act_order_from_keys(o: dict, qcfg: dict) -> str:
    """Read back `act_order`; checkpoints without it (older quantkit, GPTQModel, AutoGPTQ) go by
    desc_act + static_groups, where desc_act with static groups meant act-order over a trivial g_idx."""
    desc = bool(o.get("desc_act", qcfg.get("desc_act", False)))
    recorded = o.get("act_order", qcfg.get("act_order"))
    if recorded is None:
        static = bool(o.get("static_groups", qcfg.get("static_groups", False)))
        return "none" if not desc else ("static" if static else "dynamic")
    if recorded not in ("none", "static", "dynamic"):
        raise QuantkitError(f"gptq: act_order {recorded!r} is not one of none, static, dynamic")
    if (recorded == "dynamic") != desc and not (recorded == "static" and desc):
        raise QuantkitError(f"gptq: act_order {recorded!r} contradicts desc_act={desc} "
                            "(only act_order 'dynamic' stores a g_idx that loaders must follow)")
    return recorded


def _check_extra_act_order(extra: dict, act_order: str, group_size: int) -> None:
    """The quantizer's options (desc_act = processed in act-order, static_groups) must agree with
    the act-order the weights record; the config's own keys are then written from the weights."""
    if "desc_act" in extra and bool(extra["desc_act"]) != (act_order != "none"):
        raise QuantkitError(f"gptq: extra desc_act={extra['desc_act']} contradicts act-order {act_order!r}")
    if "static_groups" in extra and act_order != "none" and group_size != -1 \
            and bool(extra["static_groups"]) != (act_order == "static"):
        raise QuantkitError(f"gptq: extra static_groups={extra['static_groups']} contradicts act-order {act_order!r}")


def quantization_config(spec_by_module: dict[str, LinearSpec], ignore: list[str], extra: dict) -> dict:
    """GPTQ config; modules whose scheme differs from the commonest one, and ignored modules,
    become GPTQModel `dynamic` rules ("+:^name$" overrides, "-:^name$" skips)."""
    if not spec_by_module:
        raise QuantkitError("gptq: no quantized modules to describe")
    for name, spec in spec_by_module.items():
        _check_spec(spec)
    base = Counter(s.scheme() for s in spec_by_module.values()).most_common(1)[0][0]
    bits, group_size, sym, act_order = base[:4]
    keys = _act_order_keys(act_order)
    extra = dict(extra or {})
    _check_extra_act_order(extra, act_order, group_size)
    if act_order == "none":  # static groups without act-order: GPTQModel's meaning of the key, as given
        keys["static_groups"] = bool(extra.get("static_groups", False))
    dynamic = dict(extra.pop("dynamic", None) or {})
    skipped = [n for n in ignore if not _is_lm_head(n) and n not in spec_by_module]
    grouped = _fused_rules(spec_by_module, skipped, base)
    in_group = {m for members in grouped.values() for m in members}
    for pattern, members in grouped.items():
        spec = spec_by_module.get(members[0])
        dynamic[pattern] = {} if spec is None else _override_keys(spec)
    for name, spec in spec_by_module.items():
        if spec.scheme() != base and name not in in_group:
            dynamic[f"+:^{re.escape(name)}$"] = _override_keys(spec)
    for name in skipped:
        if name not in in_group:
            dynamic[f"-:^{re.escape(name)}$"] = {}
    cfg = {**_DEFAULTS, **extra}
    cfg.update(quant_method="gptq", bits=bits, group_size=group_size, sym=sym, checkpoint_format="gptq",
               lm_head=any(_is_lm_head(m) for m in spec_by_module), **keys)
    if dynamic:
        cfg["dynamic"] = dynamic
    return cfg


def _override_keys(spec: LinearSpec) -> dict:
    return {"bits": spec.bits, "group_size": spec.group_size, "sym": spec.sym, **_act_order_keys(spec.act_order)}


def _fused_rules(spec_by_module: dict[str, LinearSpec], skipped: list[str], base: tuple) -> dict[str, list[str]]:
    """One rule per group of linears vLLM fuses (q/k/v, gate/up) that is all overridden to one scheme or all
    skipped: `{"+:^parent\\.(?:q_proj|k_proj|v_proj|qkv_proj)$": members}` ("-:" for skipped), so the
    rule matches the checkpoint's names (quantkit, GPTQModel) and vLLM's fused one. A group whose
    members differ is left to per-module rules (vLLM cannot serve it: quantkit.formats.loaders)."""
    from quantkit.formats.fused_linears import fused_groups

    rules = {}
    for fused, members in fused_groups([*spec_by_module, *skipped]).items():
        schemes = {spec_by_module[m].scheme() if m in spec_by_module else None for m in members}
        if len(schemes) != 1 or schemes == {base}:
            continue
        parent = fused.rpartition(".")[0]
        leaves = "|".join(re.escape(m.rpartition(".")[2]) for m in [*members, fused])
        prefix = f"{re.escape(parent)}\\." if parent else ""
        rules[f"{'-' if schemes == {None} else '+'}:^{prefix}(?:{leaves})$"] = members
    return rules


def _is_lm_head(name: str) -> bool:
    return name == "lm_head" or name.endswith(".lm_head")


def _dynamic_override(dynamic: dict, name: str):
    """GPTQModel's dynamic_get: first matching rule wins; "-:" skips, "+:" (or bare) overrides."""
    for pattern, overrides in dynamic.items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], name):
                return False
        elif re.match(pattern[2:] if pattern.startswith("+:") else pattern, name):
            return overrides or {}
    return None


def parse_quantization_config(qcfg: dict, linear_names: list[str],
                              linear_shapes: dict[str, tuple[int, int]]) -> dict[str, LinearSpec]:
    method = str(qcfg.get("quant_method", "")).lower()
    if method != "gptq":
        raise QuantkitError(f"gptq: quant_method is {qcfg.get('quant_method')!r}, expected 'gptq'")
    fmt = str(qcfg.get("checkpoint_format", qcfg.get("format", "gptq")) or "gptq").lower()
    if fmt != "gptq":
        raise QuantkitError(f"gptq: checkpoint_format {fmt!r} is not supported (only 'gptq', i.e. v1)")

    for key in ("bits", "group_size"):
        if not isinstance(qcfg.get(key), int) or isinstance(qcfg.get(key), bool):
            raise QuantkitError(f"gptq: quantization_config needs an integer {key!r}, got {qcfg.get(key)!r}")

    def spec_for(name: str, o: dict) -> LinearSpec:
        bits, gs = int(o.get("bits", qcfg["bits"])), int(o.get("group_size", qcfg["group_size"]))
        out_f, in_f = linear_shapes[name]
        spec = LinearSpec(out_features=out_f, in_features=in_f, bits=bits, group_size=gs,
                          sym=bool(o.get("sym", qcfg.get("sym", True))), act_order=_act_order_from_keys(o, qcfg))
        _check_spec(spec)
        return spec

    dynamic = qcfg.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise QuantkitError("gptq: 'dynamic' must be a mapping of module regex to overrides")
    skip = list(qcfg.get("modules_to_not_convert") or [])
    out: dict[str, LinearSpec] = {}
    for name in linear_names:
        override = _dynamic_override(dynamic, name)
        if override is False or any(s == name or s in name for s in skip):
            continue
        if _is_lm_head(name) and not qcfg.get("lm_head", False) and override is None:
            continue
        out[name] = spec_for(name, override or {})
    return out
