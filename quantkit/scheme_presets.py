"""Named quantization schemes (issue #47): the compressed-tensors / llm-compressor preset names as typed values.

`quantkit.scheme.QuantScheme` describes integer weight grids chosen by flags (--bits/--group-size/--sym).
A preset names a whole deployment recipe instead (FP8, NVFP4, MXFP4, W4AFP8, ...): the weight grid
*and* how a runtime quantizes the layer's input activations.  This module only describes them; the
float grids themselves live in `quantkit.float_codecs`, their checkpoint layouts in `quantkit.formats.ct_*`.

The values follow compressed-tensors 0.20.1's `quantization/quant_scheme.py` (PRESET_SCHEMES); a test
compares every field with that table, so a drift in either is caught.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from quantkit.errors import QuantkitError

KINDS = ("int", "float")
# "tensor_group": groups with an extra per-tensor (global) scale, as NVFP4 does;
# "token": one scale per row of an activation (activations only).
STRATEGIES = ("tensor", "channel", "group", "tensor_group", "block", "token")
SCALE_DTYPES = (None, "float8_e4m3fn", "uint8")  # None: the model's float dtype; uint8: E8M0 exponents
DYNAMIC = (False, True, "local")  # "local": per-group scales at run time under a calibrated global scale


@dataclass(frozen=True)
class QuantArgs:
    """How one tensor role (weights or input activations) is quantized."""

    kind: str  # "int" or "float"
    bits: int
    strategy: str
    group_size: Optional[int] = None  # group / tensor_group strategies
    block_size: Optional[tuple[int, int]] = None  # block strategy: (rows, cols)
    scale_dtype: Optional[str] = None
    dynamic: Union[bool, str] = False
    symmetric: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise QuantkitError(f"unknown quantization kind {self.kind!r}; choose int or float")
        if self.strategy not in STRATEGIES:
            raise QuantkitError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if self.kind == "float" and self.bits not in (4, 8):
            raise QuantkitError(f"float grids are FP4 (E2M1) or FP8 (E4M3), not {self.bits}-bit")
        if self.kind == "int" and not 2 <= self.bits <= 8:
            raise QuantkitError(f"integer grids are 2..8-bit, not {self.bits}-bit")
        grouped = self.strategy in ("group", "tensor_group")
        if grouped != (self.group_size is not None) or (grouped and self.group_size <= 0):
            raise QuantkitError(f"strategy {self.strategy!r} needs a positive group size exactly when grouped, "
                                f"got group_size={self.group_size!r}")
        if (self.strategy == "block") != (self.block_size is not None):
            raise QuantkitError("a block size (rows, cols) goes with strategy 'block' only")
        if self.scale_dtype not in SCALE_DTYPES:
            raise QuantkitError(f"unknown scale dtype {self.scale_dtype!r}; choose float8_e4m3fn, uint8 or none")
        if self.dynamic not in DYNAMIC:
            raise QuantkitError(f"dynamic must be true, false or 'local', not {self.dynamic!r}")
        if self.kind == "float" and not self.symmetric:
            raise QuantkitError("float grids are symmetric only")


@dataclass(frozen=True)
class SchemePreset:
    """A named scheme: the weights' grid and, for W*A<16 schemes, the input activations' grid."""

    name: str
    weights: QuantArgs
    input_activations: Optional[QuantArgs] = None

    @property
    def weight_only(self) -> bool:
        return self.input_activations is None

    @property
    def calibrates_activations(self) -> bool:
        """Whether the checkpoint stores an input scale measured on calibration data (FP8's static input_scale,
        NVFP4's input_global_scale), so even round-to-nearest needs calibration tokens."""
        return self.input_activations is not None and self.input_activations.dynamic is not True

    @property
    def float_grid(self) -> bool:
        """Whether weights or activations are on a float grid: written by `quantkit.float_checkpoint` (W4AFP8's
        int4 weights too), not by the integer path."""
        return self.weights.kind == "float" or (self.input_activations is not None
                                                and self.input_activations.kind == "float")


def _int_weights(bits: int, strategy: str = "group", group_size: Optional[int] = 128, sym: bool = True) -> QuantArgs:
    return QuantArgs("int", bits, strategy, group_size=group_size, symmetric=sym)


_FP8_TOKEN = QuantArgs("float", 8, "token", dynamic=True)
_FP4_GROUP16 = dict(group_size=16, scale_dtype="float8_e4m3fn")
_MX_GROUP32 = dict(group_size=32, scale_dtype="uint8")  # every MX format: groups of 32 under an E8M0 exponent

PRESETS: dict[str, SchemePreset] = {p.name: p for p in (
    SchemePreset("FP8", QuantArgs("float", 8, "tensor"), QuantArgs("float", 8, "tensor")),
    SchemePreset("FP8_DYNAMIC", QuantArgs("float", 8, "channel"), _FP8_TOKEN),
    SchemePreset("FP8_BLOCK", QuantArgs("float", 8, "block", block_size=(128, 128)),
                 QuantArgs("float", 8, "group", group_size=128, dynamic=True)),
    SchemePreset("NVFP4A16", QuantArgs("float", 4, "tensor_group", **_FP4_GROUP16)),
    SchemePreset("NVFP4", QuantArgs("float", 4, "tensor_group", **_FP4_GROUP16),
                 QuantArgs("float", 4, "tensor_group", dynamic="local", **_FP4_GROUP16)),
    SchemePreset("MXFP4A16", QuantArgs("float", 4, "group", **_MX_GROUP32)),
    SchemePreset("MXFP4", QuantArgs("float", 4, "group", **_MX_GROUP32),
                 QuantArgs("float", 4, "group", dynamic=True, **_MX_GROUP32)),
    # MXFP4 weights under FP8 inputs in groups of 128 (FP8_BLOCK's activations): compressed-tensors' MXFP4xFP8
    SchemePreset("MXFP4XFP8", QuantArgs("float", 4, "group", **_MX_GROUP32),
                 QuantArgs("float", 8, "group", group_size=128, dynamic=True)),
    SchemePreset("MXFP8A16", QuantArgs("float", 8, "group", **_MX_GROUP32)),
    SchemePreset("MXFP8", QuantArgs("float", 8, "group", **_MX_GROUP32),
                 QuantArgs("float", 8, "group", dynamic=True, **_MX_GROUP32)),
    SchemePreset("W4AFP8", _int_weights(4), _FP8_TOKEN),
    SchemePreset("W4A16", _int_weights(4)),
    SchemePreset("W8A16", _int_weights(8)),
    SchemePreset("W8A8", _int_weights(8, "channel", None), QuantArgs("int", 8, "token", dynamic=True)),
)}


def preset(name: str) -> SchemePreset:
    """The preset called `name` (case-insensitive), or a one-line error listing the names."""
    found = PRESETS.get(str(name).strip().upper())
    if found is None:
        raise QuantkitError(f"unknown scheme {name!r}; choose one of {', '.join(PRESETS)}")
    return found


def check_flags_agree(p: SchemePreset, bits: Optional[int] = None, group_size: Optional[int] = None,
                      sym: Optional[bool] = None) -> None:
    """Refuse --bits/--group-size/--sym values that contradict the named scheme's weights (None: not given).

    Group size -1 means per channel, as in `quantkit.scheme`; a block or per-tensor scheme has no group size.
    """
    w = p.weights
    if bits is not None and bits != w.bits:
        raise QuantkitError(f"--scheme {p.name} quantizes weights to {w.bits} bits, not --bits {bits}; drop --bits")
    if group_size is not None:
        own = {"group": w.group_size, "tensor_group": w.group_size, "channel": -1}.get(w.strategy)
        if group_size != own:
            what = f"groups of {own}" if own not in (None, -1) else ("per channel" if own == -1 else w.strategy)
            raise QuantkitError(f"--scheme {p.name} quantizes weights {what}, not --group-size {group_size}; "
                                "drop --group-size")
    if sym is not None and sym != w.symmetric:
        raise QuantkitError(f"--scheme {p.name} is {'symmetric' if w.symmetric else 'asymmetric'}; drop --sym/--asym")
