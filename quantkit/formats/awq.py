"""AWQ GEMM layout (quant_method "awq", version "gemm"), as AutoAWQ's WQLinear_GEMM writes it.

    qweight int32 [K, N/8]   4-bit codes packed along the *output* dim; word slot i (bits 4i..4i+3)
                             holds column 8*word + ORDER[i], ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
    qzeros  int32 [G, N/8]   the true zero (no minus one), same packing and interleave
    scales  fp16  [G, N]
No g_idx, so dynamic act-order cannot be stored; 4-bit only. The file always carries zeros
(config zero_point true), so a symmetric weight is stored as zeros of 8 and reads back as asymmetric.
A file whose config says zero_point false (GPTQModel's symmetric AWQ) still carries qzeros, all 8
(GEMM kernels always read them): it loads as symmetric once every stored zero is checked to be 8.
"""
from __future__ import annotations

from collections import Counter

import torch

from quantkit.errors import QuantkitError
from quantkit.formats import bitpack, checks, registry
from quantkit.formats.spec import LinearSpec
from quantkit.qtensor import QuantizedWeight

NAME = "awq"
SYMMETRIC_ZERO = 8  # the zero a symmetric 4-bit grid stores: codes 0..15 around 2**(4-1)
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _interleave(n: int) -> torch.Tensor:
    """Column held by each packed position: position j of the unpacked row is column perm[j]."""
    return (torch.arange(n).view(-1, 8)[:, list(ORDER)]).reshape(-1)


def _check_spec(spec: LinearSpec) -> None:
    """The scheme as `registry.AwqFormat` declares it, then this linear's shape."""
    registry.refuse_unless_stored(NAME, spec)
    if spec.out_features % 8:
        raise QuantkitError(f"awq needs out_features ({spec.out_features}) divisible by 8")
    if spec.group_size != -1 and spec.in_features % spec.group_size:
        raise QuantkitError(f"awq: group_size {spec.group_size} must divide in_features {spec.in_features}")


def packed_shapes(spec: LinearSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    _check_spec(spec)
    n, k, g = spec.out_features, spec.in_features, spec.n_groups
    return {
        "qweight": ((k, n // 8), torch.int32),
        "qzeros": ((g, n // 8), torch.int32),
        "scales": ((g, n), torch.float16),
    }


def default_tensors(spec: LinearSpec) -> dict[str, torch.Tensor]:
    """Tensors a checkpoint may omit: none."""
    return {}


def pack(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    spec = checks.quantized_weight(qw, NAME)
    _check_spec(spec)
    perm = _interleave(spec.out_features)
    return {
        "qweight": bitpack.pack(qw.qweight.t()[:, perm], 4, dim=1),
        "qzeros": bitpack.pack(qw.zeros.t()[:, perm], 4, dim=1),
        "scales": checks.fp16_scales(qw.scales.t().contiguous(), NAME),
    }


def unpack(tensors: dict[str, torch.Tensor], spec: LinearSpec) -> QuantizedWeight:
    shapes = packed_shapes(spec)
    n, k = spec.out_features, spec.in_features
    qweight = checks.tensor(tensors, "qweight", shapes["qweight"][0], (torch.int32,), NAME)
    qzeros = checks.tensor(tensors, "qzeros", shapes["qzeros"][0], (torch.int32,), NAME)
    scales = checks.tensor(tensors, "scales", shapes["scales"][0], checks.FLOAT_DTYPES, NAME)
    inverse = torch.argsort(_interleave(n))
    codes = bitpack.unpack(qweight.cpu(), 4, n, dim=1)[:, inverse]
    zeros = bitpack.unpack(qzeros.cpu(), 4, n, dim=1)[:, inverse]
    if spec.sym and not bool((zeros == SYMMETRIC_ZERO).all()):
        raise QuantkitError(f"awq: the config says zero_point false (symmetric) but qzeros holds values other "
                            f"than {SYMMETRIC_ZERO}; fix the checkpoint's config.json to zero_point true")
    return QuantizedWeight(
        qweight=codes.t().contiguous(),
        scales=scales.cpu().float().t().contiguous(),
        zeros=zeros.t().to(torch.int32).contiguous(),
        g_idx=spec.trivial_g_idx(),
        bits=4,
        group_size=spec.group_size,
        sym=spec.sym,
        act_order=spec.act_order,
    )


# ---------------------------------------------------------------- config.json

def quantization_config(spec_by_module: dict[str, LinearSpec], ignore: list[str], extra: dict) -> dict:
    """AWQ has one scheme per model: mixed bit widths or group sizes are refused."""
    if not spec_by_module:
        raise QuantkitError("awq: no quantized modules to describe")
    for spec in spec_by_module.values():
        _check_spec(spec)
    schemes = Counter((s.bits, s.group_size) for s in spec_by_module.values())
    if len(schemes) > 1:
        raise QuantkitError(f"awq stores one scheme per model, got {sorted(schemes)}: use gptq or "
                            "compressed-tensors for per-module overrides")
    (bits, group_size), = schemes
    return {**(extra or {}), "quant_method": "awq", "bits": bits, "group_size": group_size,
            "zero_point": True, "version": "gemm", "modules_to_not_convert": list(ignore) or None}


def parse_quantization_config(qcfg: dict, linear_names: list[str],
                              linear_shapes: dict[str, tuple[int, int]]) -> dict[str, LinearSpec]:
    if str(qcfg.get("quant_method", "")).lower() != "awq":
        raise QuantkitError(f"awq: quant_method is {qcfg.get('quant_method')!r}, expected 'awq'")
    version = str(qcfg.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantkitError(f"awq: version {version!r} is not supported (only 'gemm')")
    sym = not qcfg.get("zero_point", True)  # symmetric: the stored zeros must all be 8 (checked in unpack)
    bits = qcfg.get("bits", qcfg.get("w_bit"))
    group_size = qcfg.get("group_size", qcfg.get("q_group_size"))
    if bits != 4 or not isinstance(group_size, int):
        raise QuantkitError(f"awq: needs bits 4 and an integer group_size, got bits={bits!r} "
                            f"group_size={group_size!r}")
    skip = list(qcfg.get("modules_to_not_convert") or [])
    out: dict[str, LinearSpec] = {}
    for name in linear_names:
        # transformers' rule: substring match; lm_head stays unquantized
        if name == "lm_head" or name.endswith(".lm_head") or any(s in name for s in skip):
            continue
        out_f, in_f = linear_shapes[name]
        spec = LinearSpec(out_features=out_f, in_features=in_f, bits=4, group_size=group_size, sym=sym)
        _check_spec(spec)
        out[name] = spec
    return out
