"""Round-to-nearest: the baseline every other method must beat, and the quickest path to a checkpoint."""
from __future__ import annotations

from torch import nn

from quantkit.quantizers.base import Quantizer, register_step
from quantkit.quantizers.grid import rtn_quantize
from quantkit.scheme import LinearScheme


@register_step
class RTNQuantizer(Quantizer):
    name = "rtn"
    needs_calibration = False
    observes = False

    def quantize_linear(self, name: str, module: nn.Linear, scheme: LinearScheme):
        return rtn_quantize(module.weight.data, scheme.bits, scheme.group_size, scheme.sym, module.bias)
