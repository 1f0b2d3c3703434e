"""Round-to-nearest: the baseline every other method must beat, and the quickest path to a checkpoint."""
from __future__ import annotations

from torch import nn

from quantkit.quantizers.base import Quantizer, register_step
from quantkit.quantizers.grid import check_sym_range
from quantkit.scheme import LinearScheme


@register_step
class RTNQuantizer(Quantizer):
    name = "rtn"
    needs_calibration = False
    observes = False
    # mse: each group's range shrunk to the one with the lowest rounding error (still no data), by
    # GPTQ's coarse-to-fine search: lower KL than plain min/max on both held-out texts and than
    # llm-compressor's RTN (docs/defaults.yaml); mse=false is plain min/max round-to-nearest
    # sym_range: where a symmetric grid puts +-absmax (quantizers.grid.SYM_RANGES); awq finishes on
    # "exact", the grid its searches simulate
    options_spec = {"mse": True, "sym_range": "centred"}

    supports_grids = True

    def __init__(self, **options):
        super().__init__(**options)
        check_sym_range(self.options["sym_range"], "rtn option ")

    def quantize_linear(self, name: str, module: nn.Linear, scheme: LinearScheme):
        return self.round_to_nearest(module, scheme)  # with this quantizer's mse and sym_range
