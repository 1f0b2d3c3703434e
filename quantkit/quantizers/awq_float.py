"""AWQ's scale search before a float preset (`--method awq` / `awq,gptq` with `--scheme NVFP4A16`, MXFP4A16, ...).

Why: a 4-bit float grid loses most on the weight columns that meet the largest activations; AWQ scales those
columns up (and divides the norm or linear before them by the same), which is exact in full precision, so
their rounding error shrinks relative to their effect. `FloatAWQ` is `AWQTransform` whose candidate scales
are judged with the weights rounded to nearest on the preset's own grid (the format's scales,
`float_codecs.fixed_grid`: NVFP4's E4M3 group scales under the global scale the scaled weight gets, MXFP4's
E8M0 exponents, FP8's channel or block scales) instead of integer groups. AWQ's weight clipping is off: on
these grids the format's range search (`mse`, `float_codecs.scale_search`) chooses smaller scales per group
with the format's own values, which is what clipping does on an integer grid. It runs as a pass before the
preset's rounding or GPTQ (`float_passes`). Activations are not simulated (as in AWQ for W4A16); where the
preset quantizes them, SmoothQuant's pass is the one that judges with them.
"""
from __future__ import annotations

import torch

from quantkit.errors import QuantkitError
from quantkit.float_codecs.fixed_grid import fixed_grid
from quantkit.quantizers import float_passes
from quantkit.quantizers.awq import AWQTransform
from quantkit.scheme import LinearScheme
from quantkit.scheme_presets import SchemePreset

# AWQ's options that mean something before a float preset (clipping and the integer grid's sym_range do not)
OPTIONS = ("duo_scaling", "n_grid", "full_grid", "max_search_tokens", "token_search_tokens", "inputs", "gqa_v_o")


class FloatAWQ(float_passes.PresetTransform, AWQTransform):
    """AWQ's scale search judged on `preset`'s weight grid (module docstring)."""

    name = "awq"

    def __init__(self, preset: SchemePreset, **options):
        if preset.weights.kind != "float":  # float_checkpoint.write runs the integer AWQ for those
            raise QuantkitError(f"--scheme {preset.name} has integer weights: FloatAWQ searches float grids; the "
                                "integer AWQ transform (quantizers.awq) serves it")
        super().__init__(**options, clip=False)
        self.preset = preset
        self.needs_calibration = True

    def _fake_weight(self, name: str, w: torch.Tensor, scheme: LinearScheme) -> torch.Tensor:
        return fixed_grid(w, self.preset.weights).rtn.dequantize()


PASS = float_passes.register(float_passes.FloatPass(
    "awq", FloatAWQ, OPTIONS, refusal_hint=" (the format's range search, mse, plays clipping's part)"))
