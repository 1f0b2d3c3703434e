"""llama.cpp's tensor types and file-type mixes, as plain data.

Shared by the grid quantizers (which must produce weights llama.cpp can hold) and the GGUF packer
(which stores them), so neither imports the other. Block sizes, byte sizes and grid conventions
follow ggml-common.h (`block_q4_0` ... `block_q6_K`) and ggml-quants.c's `dequantize_row_*`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from quantkit.errors import QuantkitError

QK_K = 256  # k-quant super-block


@dataclass(frozen=True)
class GGMLType:
    name: str
    id: int  # GGMLQuantizationType value
    block: int  # weights per block (1 for float types)
    nbytes: int  # bytes per block
    bits: int = 0  # code width; 0 for float types
    group: int = 0  # columns sharing one scale
    zero: Optional[int] = None  # integer zero of a symmetric grid; None: float offset (value = d*q + m)
    two_level: bool = False  # k-quant: fp16 d (and dmin) per super-block, integer sc (and m) per group
    sub_range: tuple[int, int] = (0, 0)  # k-quant sub-scale range (6-bit unsigned, or int8 for Q6_K)

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / self.block

    def row_bytes(self, k: int) -> int:
        return k // self.block * self.nbytes


TYPES = {t.name: t for t in (
    GGMLType("F32", 0, 1, 4),
    GGMLType("F16", 1, 1, 2),
    GGMLType("BF16", 30, 1, 2),
    GGMLType("Q4_0", 2, 32, 18, bits=4, group=32, zero=8),
    GGMLType("Q4_1", 3, 32, 20, bits=4, group=32),
    GGMLType("Q5_0", 6, 32, 22, bits=5, group=32, zero=16),
    GGMLType("Q5_1", 7, 32, 24, bits=5, group=32),
    GGMLType("Q8_0", 8, 32, 34, bits=8, group=32, zero=128),
    GGMLType("Q4_K", 12, QK_K, 144, bits=4, group=32, two_level=True, sub_range=(0, 63)),
    GGMLType("Q5_K", 13, QK_K, 176, bits=5, group=32, two_level=True, sub_range=(0, 63)),
    GGMLType("Q6_K", 14, QK_K, 210, bits=6, group=16, zero=32, two_level=True, sub_range=(-128, 127)),
)}
TYPES_BY_ID = {t.id: t for t in TYPES.values()}

# llama.cpp's mixes (llama_ftype_get_default_type): the type most tensors get; the per-tensor
# exceptions are in quantkit.formats.gguf.plan
MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}

# llama_ftype values written as general.file_type (informational for llama.cpp); a pure k-quant
# file is recorded as its _S mix, the closest llama.cpp has
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K": 14, "Q4_K_M": 15,
              "Q5_K": 16, "Q5_K_M": 17, "Q6_K": 18, "BF16": 32}

GGUF_TYPE_CHOICES = tuple(FILE_TYPES)


def ggml_type(name: str) -> GGMLType:
    key = str(name).upper()
    if key not in TYPES:
        raise QuantkitError(f"unknown GGUF tensor type {name!r}; quantkit writes {', '.join(TYPES)}")
    return TYPES[key]


def check_gguf_type(name: str) -> str:
    """A --gguf-type value (a tensor type or a mix), normalised; refuses anything else."""
    key = str(name).upper()
    if key not in FILE_TYPES:
        raise QuantkitError(f"unknown --gguf-type {name!r}; choose one of {', '.join(GGUF_TYPE_CHOICES)}")
    return key


def fallback(t: GGMLType, k: int) -> GGMLType:
    """llama-quantize's tensor_type_fallback: a row of k columns that the block does not divide takes
    a 32-block type (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), and F16 if 32 does not divide it either."""
    if not t.quantized or k % t.block == 0:
        return t
    demoted = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}.get(t.name, t.name)
    out = TYPES[demoted]
    return out if k % out.block == 0 else TYPES["F16"]
