"""`LinearSpec` for the formats: the shape and scheme of one quantized linear (defined beside
`QuantizedWeight` in `quantkit.qtensor`, which steps and formats both build on)."""
from quantkit.qtensor import ACT_ORDERS, INPUT_QUANTS, LinearSpec  # noqa: F401
