"""Runtime for packed checkpoints: `QuantLinear` and the matmul backends behind it."""
from quantkit.runtime.backends import BACKENDS  # noqa: F401
from quantkit.runtime.quant_linear import QuantLinear  # noqa: F401

__all__ = ["BACKENDS", "QuantLinear"]
