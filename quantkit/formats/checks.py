"""Validation shared by the format modules: checkpoints are untrusted input.

Every tensor a loader reads is checked for presence, shape and dtype before any bit is
unpacked, and every `QuantizedWeight` a writer packs is checked for internal consistency, so
a corrupt file or a quantizer bug fails with one line naming the tensor instead of a wrong model.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

from quantkit.errors import QuantkitError
from quantkit.qtensor import QuantizedWeight

from quantkit.formats.spec import LinearSpec

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def tensor(tensors: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...],
           dtypes: Iterable[torch.dtype], fmt: str) -> torch.Tensor:
    """Return tensors[name] after checking it exists with the expected shape and one of `dtypes`."""
    dtypes = tuple(dtypes)
    if name not in tensors:
        raise QuantkitError(f"{fmt}: missing tensor '{name}' (have {sorted(tensors)})")
    t = tensors[name]
    if not isinstance(t, torch.Tensor):
        raise QuantkitError(f"{fmt}: '{name}' is not a tensor")
    if tuple(t.shape) != tuple(shape):
        raise QuantkitError(f"{fmt}: tensor '{name}' has shape {list(t.shape)}, expected {list(shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise QuantkitError(f"{fmt}: tensor '{name}' has dtype {str(t.dtype).replace('torch.', '')}, expected {names}")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise QuantkitError(f"{fmt}: tensor '{name}' contains NaN/inf values")
    return t


def g_idx(g: torch.Tensor, spec: LinearSpec, fmt: str, name: str = "g_idx") -> torch.Tensor:
    """Check a group index against the spec: in range, and trivial unless act-order is dynamic."""
    g = g.to(torch.int32).cpu()
    if g.numel() and (int(g.min()) < 0 or int(g.max()) >= spec.n_groups):
        raise QuantkitError(f"{fmt}: '{name}' has values outside [0, {spec.n_groups})")
    if spec.act_order == "dynamic":
        counts = torch.bincount(g.long(), minlength=spec.n_groups)
        expected = torch.bincount(spec.trivial_g_idx().long(), minlength=spec.n_groups)
        if not torch.equal(counts, expected):
            raise QuantkitError(f"{fmt}: '{name}' does not assign {spec.effective_group_size} columns to each group")
    elif not torch.equal(g, spec.trivial_g_idx()):
        raise QuantkitError(f"{fmt}: '{name}' is not k // group_size although act-order is {spec.act_order!r} "
                            "(a permuted g_idx needs desc_act without static_groups)")
    return g


def quantized_weight(qw: QuantizedWeight, fmt: str) -> LinearSpec:
    """Check a QuantizedWeight's tensors agree with each other; return its spec."""
    spec = LinearSpec.of(qw)
    n, k, groups = spec.out_features, spec.in_features, spec.n_groups
    if qw.offsets is not None or qw.two_level is not None:
        raise QuantkitError(f"{fmt} stores integer zero points only; this weight is on a float-offset or two-level "
                            "grid (GGUF Q4_1/Q5_1/k-quants), which it cannot hold exactly: keep --format gguf")
    if qw.qweight.dtype != torch.uint8:
        raise QuantkitError(f"{fmt}: qweight codes must be uint8, got {qw.qweight.dtype}")
    for name, t, shape in (("scales", qw.scales, (n, groups)), ("zeros", qw.zeros, (n, groups)),
                           ("g_idx", qw.g_idx, (k,))):
        if tuple(t.shape) != shape:
            raise QuantkitError(f"{fmt}: QuantizedWeight.{name} has shape {list(t.shape)}, expected {list(shape)}")
    if int(qw.qweight.max()) > spec.max_code:
        raise QuantkitError(f"{fmt}: qweight has codes above {spec.max_code} for {spec.bits}-bit")
    z = qw.zeros
    if int(z.min()) < 0 or int(z.max()) > spec.max_code:
        raise QuantkitError(f"{fmt}: zeros outside [0, {spec.max_code}]")
    g_idx(qw.g_idx, spec, fmt)
    return spec


def fp16_scales(scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """Scales as fp16, refusing values fp16 cannot hold exactly (the checkpoint would lie)."""
    s16 = scales.to(torch.float16)
    if not torch.equal(s16.float(), scales.float()):
        raise QuantkitError(f"{fmt}: scales are not exactly representable in float16 "
                            "(round them to fp16 before computing codes)")
    return s16
