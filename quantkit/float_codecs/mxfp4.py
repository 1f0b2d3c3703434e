"""MXFP4: E2M1 elements in groups of 32 sharing one power-of-two scale stored as an E8M0 byte.

code = E2M1(w / 2**(e - 127)) with e the group's E8M0 code (`e8m0.shared_exponent_codes`); values past
the grid's +-6 saturate.  This is the weight layout gpt-oss ships and compressed-tensors' MXFP4 preset.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.float_codecs import e2m1, e8m0, scale_search
from quantkit.float_codecs.nvfp4 import check_grouped_shape

GROUP_SIZE = 32


@dataclass(frozen=True)
class Mxfp4Weight:
    codes: torch.Tensor  # uint8 [N, K], E2M1 codes 0..15
    scale_codes: torch.Tensor  # uint8 [N, K/32], E8M0

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.codes.shape
        values = e2m1.decode(self.codes).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        return (values * e8m0.decode(self.scale_codes).unsqueeze(-1)).reshape(n, k).to(dtype)


@torch.no_grad()  # as the codec's: rounding has no gradient (the codes are integers)
def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """quantize(x).dequantize() of a 2-D `x` (an activation: absmax exponents, no search), value for value, without
    the codes (`e2m1.fake_quantize_groups`): a runtime's MXFP4 input rounding at a fraction of the codec's cost."""
    check_grouped_shape(x, GROUP_SIZE, "MXFP4")
    return e2m1.fake_quantize_groups(
        x, GROUP_SIZE, lambda groups, _: e8m0.decode(e8m0.shared_exponent_codes(groups.abs().amax(dim=-1))).unsqueeze(-1))


def quantize(weight: torch.Tensor, search: bool = False, importance: torch.Tensor | None = None) -> Mxfp4Weight:
    """Round-to-nearest MXFP4 of a 2-D weight [N, K] (K a multiple of 32). With `search`, each group's E8M0
    exponent is e (the absmax rule) or e - 1, whichever rounds the group with the lower squared error
    (`scale_search`; each element's error weighted by its column's `importance` [K] when given)."""
    check_grouped_shape(weight, GROUP_SIZE, "MXFP4")
    w = weight.to(torch.float32)
    n, k = w.shape
    groups = w.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    scale_codes = e8m0.shared_exponent_codes(groups.abs().amax(dim=-1))
    if search:
        imp = scale_search.column_weights(importance, 1, *groups.shape[1:])
        scale_codes = _searched_exponents(groups, scale_codes, imp)
    codes = e2m1.encode(groups / e8m0.decode(scale_codes).unsqueeze(-1))
    return Mxfp4Weight(codes.reshape(n, k), scale_codes)


def _searched_exponents(groups: torch.Tensor, scale_codes: torch.Tensor,
                        importance: torch.Tensor | None = None) -> torch.Tensor:
    """Each group's E8M0 code (uint8 [N, G]) among `scale_codes` plus `scale_search.MXFP4_EXPONENT_OFFSETS`
    (kept within 0..254): the lowest squared error of the group rounded under it."""
    code = scale_codes.to(torch.int16)
    offsets = torch.tensor(scale_search.MXFP4_EXPONENT_OFFSETS, dtype=torch.int16, device=code.device)
    codes = (code.unsqueeze(0) + offsets.view(-1, 1, 1)).clamp(0, 254).unsqueeze(-1)  # [T, N, G, 1]
    codes[0] = code.unsqueeze(-1)  # candidate 0 is the absmax exponent itself
    best = scale_search.lowest_error(groups.abs(), e8m0.decode(codes), scale_search.e2m1_magnitude, reduce_dims=(-1,),
                                     importance=importance)
    return scale_search.take(codes, best).squeeze(-1).to(torch.uint8)
