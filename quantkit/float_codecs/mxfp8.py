"""MXFP8: E4M3 elements in groups of 32 sharing one power-of-two scale stored as an E8M0 byte.

value = E4M3(w / 2**(e - 127)) with e the group's E8M0 code: compressed-tensors 0.20.1's `generate_mx_scales`
for 8-bit elements, i.e. the group's absolute maximum rounded to a power of two (a mantissa of 1.75 or more
rounds up, the same threshold as MXFP4's) minus E4M3's largest exponent, 8 (448 = 1.75 * 2**8), so the largest
element lands in [128, 448) and nothing saturates. The OCP MX spec's MXFP8 (E4M3) and compressed-tensors'
MXFP8A16 / MXFP8 presets; Blackwell GPUs run it natively.

No range search: an E4M3 element keeps three mantissa bits wherever the scale puts it (within its normal
range), so moving the shared exponent changes little but which small elements turn subnormal.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.float_codecs import e4m3, e8m0
from quantkit.float_codecs.nvfp4 import check_grouped_shape

GROUP_SIZE = 32
E4M3_EMAX = 8  # floor(log2(448))


@dataclass(frozen=True)
class Mxfp8Weight:
    values: torch.Tensor  # float8_e4m3fn [N, K]
    scale_codes: torch.Tensor  # uint8 [N, K/32], E8M0

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.values.shape
        values = self.values.to(torch.float32).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        return (values * e8m0.decode(self.scale_codes).unsqueeze(-1)).reshape(n, k).to(dtype)

    def element_scale(self) -> torch.Tensor:
        """Each element's scale, float32 [N, K]."""
        return e8m0.decode(self.scale_codes).repeat_interleave(GROUP_SIZE, dim=1)


def quantize(weight: torch.Tensor, search: bool = False) -> Mxfp8Weight:
    """Round-to-nearest MXFP8 of a 2-D weight [N, K] (K a multiple of 32); `search` is refused (see above)."""
    if search:
        raise QuantkitError("MXFP8 has no range search (its E4M3 elements keep 3 mantissa bits at any scale); "
                            "drop the mse option")
    check_grouped_shape(weight, GROUP_SIZE, "MXFP8")
    w = weight.to(torch.float32)
    n, k = w.shape
    groups = w.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    scale_codes = e8m0.shared_exponent_codes(groups.abs().amax(dim=-1), E4M3_EMAX)
    values = e4m3.to_e4m3(groups / e8m0.decode(scale_codes).unsqueeze(-1))
    return Mxfp8Weight(values.reshape(n, k), scale_codes)
