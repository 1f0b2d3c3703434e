"""Quantization methods: one module per method, registered by name (see base.py)."""
from quantkit.quantizers.base import (  # noqa: F401
    LayerContext,
    Quantizer,
    available_methods,
    get_quantizer,
    register_quantizer,
)
