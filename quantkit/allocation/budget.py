"""What a scheme costs one linear on disk, counted from the format's own packed tensor shapes.

The packed tensors (codes, scales, zero points, g_idx) are exactly what the format module writes
(`packed_shapes` is the allocation the loader makes and the writer fills), so a budget counted
here is the budget the written files hold. Average bits per weight = 8 x those bytes / weights.
"""
from __future__ import annotations

import math
import re

import torch

from quantkit.errors import QuantkitError
from quantkit.scheme import LinearScheme

# a safetensors header entry: {"name":{"dtype":"BF16","shape":[a,b],"data_offsets":[x,y]}}; an upper bound
# per tensor beyond its name, and per file (the metadata entry, 8-byte alignment)
HEADER_BYTES_PER_TENSOR = 96
HEADER_BYTES_PER_FILE = 256

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def packed_bytes(fmt, spec) -> int:
    """Bytes of one quantized linear's packed tensors in format module `fmt` (bias excluded)."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in fmt.packed_shapes(spec).values())


def candidate_costs(fmt, recipe, shapes: dict[str, tuple[int, int]],
                    candidates: dict[str, tuple[LinearScheme, ...]]) -> dict[str, dict[LinearScheme, int]]:
    """Per linear, the packed bytes of each candidate scheme the format can store (others left out)."""
    table: dict[str, dict[LinearScheme, int]] = {}
    for name, schemes in candidates.items():
        out_f, in_f = shapes[name]
        row = {}
        for s in schemes:
            try:
                row[s] = packed_bytes(fmt, recipe.planned_spec(out_f, in_f, s))
            except QuantkitError:
                continue
        if not row:
            raise QuantkitError(f"{name}: the {fmt.NAME} format stores none of the candidate schemes; "
                                "choose another --format")
        table[name] = row
    return table


def fixed_bytes(model, quantized: set[str], save_dtype: torch.dtype) -> int:
    """Bytes of everything the checkpoint holds besides the quantized linears' packed tensors: the
    unquantized tensors in `save_dtype` (a tied LM head once), quantized linears' biases in fp16 (as
    the writer stores them), and an upper bound on the safetensors headers."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    total, n_tensors = HEADER_BYTES_PER_FILE, 0
    for key, tensor in model.state_dict().items():
        if tied and key == "lm_head.weight":
            continue
        owner, _, leaf = key.rpartition(".")
        n_tensors += 1
        total += HEADER_BYTES_PER_TENSOR + len(key)
        if owner in quantized and leaf == "weight":
            continue
        if owner in quantized and leaf == "bias":
            total += tensor.numel() * 2
            continue
        total += tensor.numel() * (save_dtype.itemsize if tensor.is_floating_point() else tensor.element_size())
    # each packed linear has up to four tensors (qweight, qzeros, scales, g_idx) where it had one weight
    total += len(quantized) * 3 * (HEADER_BYTES_PER_TENSOR + 64)
    return total


def parse_size(text: str) -> int:
    """'2.1GB', '700MiB', '123456' -> bytes (GB = 10^9, GiB = 2^30)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise QuantkitError(f"--target-size {text!r} is not a size; write e.g. 2.1GB, 700MiB or a byte count")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def human_size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3f}{unit}"
    return f"{int(nbytes)}B"
