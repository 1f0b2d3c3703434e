"""Round-to-nearest: the baseline every other method must beat, and the quickest path to a checkpoint."""
from __future__ import annotations

from torch import nn

from quantkit.quantizers.base import Quantizer, register_step
from quantkit.ggml_types import ggml_type
from quantkit.quantizers.gguf_grid import rtn_on_grid
from quantkit.quantizers.grid import check_sym_range, rtn_quantize
from quantkit.scheme import LinearScheme


@register_step
class RTNQuantizer(Quantizer):
    name = "rtn"
    needs_calibration = False
    observes = False
    # mse: each group's range shrunk to the one with the lowest rounding error (still no data), by
    # GPTQ's coarse-to-fine search: lower KL than plain min/max on both held-out texts and than
    # llm-compressor's RTN (README's defaults table); mse=false is plain min/max round-to-nearest
    # sym_range: where a symmetric grid puts +-absmax (quantizers.grid.SYM_RANGES); awq finishes on
    # "exact", the grid its searches simulate
    options_spec = {"mse": True, "sym_range": "centred"}

    supports_grids = True

    def __init__(self, **options):
        super().__init__(**options)
        check_sym_range(self.options["sym_range"], "rtn option ")

    def quantize_linear(self, name: str, module: nn.Linear, scheme: LinearScheme):
        if scheme.grid is not None:  # a GGUF type's blocks, parameters chosen as llama.cpp does
            return rtn_on_grid(module.weight.data, ggml_type(scheme.grid), module.bias)
        return rtn_quantize(module.weight.data, scheme.bits, scheme.group_size, scheme.sym, module.bias,
                            mse=bool(self.options["mse"]), sym_range=self.options["sym_range"])
