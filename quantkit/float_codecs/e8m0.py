"""E8M0: an unsigned biased exponent byte, value 2**(code - 127); the shared scale of MX formats.

The exponent chosen for a group follows compressed-tensors 0.20.1 (`generate_mx_scales`, from vLLM's MXFP4
reference): the group's absolute maximum is first rounded to a power of two with the element type's
mantissa width (for E2M1, a mantissa of 1.75 or more rounds up; compressed-tensors uses that threshold for
MXFP8's E4M3 elements too), then the element's largest exponent is subtracted (2 for E2M1, whose max is
6 = 1.5 * 2**2; 8 for E4M3, 448 = 1.75 * 2**8).  (The OCP MX spec floors instead of rounding;
compressed-tensors' choice is followed so that files agree.)  Codes are clamped to 0..255.
"""
from __future__ import annotations

import torch

BIAS = 127
E2M1_EMAX = 2


def shared_exponent_codes(amax: torch.Tensor, element_emax: int = E2M1_EMAX) -> torch.Tensor:
    """E8M0 code (uint8) of the scale for groups whose absolute maximum is `amax`, elements whose largest
    exponent is `element_emax` (E2M1 by default)."""
    a = amax.to(torch.float32)
    mantissa, exponent = torch.frexp(a)  # a = mantissa * 2**exponent, mantissa in [0.5, 1)
    # a = (2 * mantissa) * 2**(exponent - 1); 2 * mantissa >= 1.75 rounds up to the next power of two
    power = (exponent - 1) + (mantissa >= 0.875).to(exponent.dtype)
    codes = (power - element_emax + BIAS).clamp(0, 255)
    return torch.where(a > 0, codes, torch.zeros_like(codes)).to(torch.uint8)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """The float32 scale 2**(code - 127) of each code (255, "NaN" in the MX spec, decodes to NaN).

    Built from the float32 bit pattern rather than exp2: CUDA's exp2 is one ulp off for the subnormal 2**-127
    (code 0), so the bits keep CPU and GPU results identical."""
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, torch.full_like(c, 1 << 22), c << 23)  # code 0: the subnormal 2**-127
    bits = torch.where(c == 255, torch.full_like(c, 0x7FC00000), bits)
    return bits.view(torch.float32)
