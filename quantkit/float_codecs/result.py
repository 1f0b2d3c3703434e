"""One linear quantized on a float grid, as the calibration pipeline carries it and the progress store keeps it.

Why here: the float GPTQ step makes these, the pipeline fake-quantizes with them, `float_checkpoint` writes them
and `quantkit.progress` saves and restores them (a float run resumed from its last finished layer), so the type
and its record form live beside the weight objects they wrap.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from quantkit.errors import QuantkitError
from quantkit.float_codecs import e8m0
from quantkit.float_codecs.fp8 import Fp8Weight
from quantkit.float_codecs.mxfp4 import Mxfp4Weight
from quantkit.float_codecs.mxfp8 import Mxfp8Weight
from quantkit.float_codecs.nvfp4 import Nvfp4Weight

WEIGHT_TYPES = {cls.__name__: cls for cls in (Fp8Weight, Mxfp8Weight, Nvfp4Weight, Mxfp4Weight)}


class FloatResult:
    """One linear quantized on a float grid: the layout's weight object, with what the pipeline asks of a
    `QuantizedWeight` while it runs in memory (`dequantize` to fake-quantize, `scales` to check, `to`), and the
    absmax of the inputs calibration saw (FP8 / NVFP4 static input scales; None when not recorded)."""

    act_order = "none"

    def __init__(self, weight, bias: Optional[torch.Tensor] = None, stats: Optional[dict] = None,
                 input_absmax: Optional[torch.Tensor] = None):
        self.weight, self.bias, self.stats, self.input_absmax = weight, bias, stats or {}, input_absmax

    @property
    def scales(self) -> torch.Tensor:
        w = self.weight
        if isinstance(w, Fp8Weight):
            return w.scale
        if isinstance(w, Nvfp4Weight):
            return w.group_scale.to(torch.float32) / w.global_scale
        return e8m0.decode(w.scale_codes)

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's [out_features, in_features]: its element codes' (E2M1) or values' (E4M3), one per element."""
        w = self.weight
        return tuple(int(d) for d in (w.codes if isinstance(w, (Nvfp4Weight, Mxfp4Weight)) else w.values).shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.dequantize(dtype)

    def to(self, device) -> "FloatResult":
        if torch.device(device).type != "cpu":
            raise QuantkitError("float-grid GPTQ keeps its results on the CPU")
        return self

    # -- the progress store's form: tensors exactly as held, the rest JSON ------------------------------
    def record(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, JSON-able meta) from which `from_record` rebuilds this result bit for bit."""
        tensors, fields = {}, {}
        for f in dataclasses.fields(self.weight):
            value = getattr(self.weight, f.name)
            if isinstance(value, torch.Tensor):
                tensors[f"weight.{f.name}"] = value.contiguous()
            else:
                fields[f.name] = list(value) if isinstance(value, tuple) else value
        for name in ("bias", "input_absmax"):
            if getattr(self, name) is not None:
                tensors[name] = getattr(self, name).contiguous()
        return tensors, {"float_weight": type(self.weight).__name__, "fields": fields, "stats": self.stats}

    @classmethod
    def from_record(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "FloatResult":
        weight_type = WEIGHT_TYPES.get(meta.get("float_weight"))
        if weight_type is None:
            raise QuantkitError(f"--resume: a progress record holds an unknown float weight type "
                                f"{meta.get('float_weight')!r}; delete the staging folder and start over")
        values = {k[len("weight."):]: v for k, v in tensors.items() if k.startswith("weight.")}
        for name, value in meta["fields"].items():
            values[name] = tuple(value) if isinstance(value, list) else value
        return cls(weight_type(**values), tensors.get("bias"), meta.get("stats"), tensors.get("input_absmax"))
