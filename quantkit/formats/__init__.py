"""On-disk layouts, one module per layout, all with the same interface.

    NAME: str
    pack(qw) -> {suffix: tensor}                     (bias excluded: the writer stores it)
    unpack(tensors, spec) -> QuantizedWeight         (validates every tensor first)
    packed_shapes(spec) -> {suffix: (shape, dtype)}  (buffers a QuantLinear allocates)
    default_tensors(spec) -> {suffix: tensor}        (values for tensors a checkpoint may omit)
    quantization_config(spec_by_module, ignore, extra) -> config.json "quantization_config"
    parse_quantization_config(qcfg, linear_names, linear_shapes) -> {module: LinearSpec}

The checkpoint writer and the runtime both go through here, so nothing else unpacks bits.
"""
from __future__ import annotations

from types import ModuleType

from quantkit.errors import QuantkitError
from quantkit.formats.spec import LinearSpec

__all__ = ["FORMATS", "LinearSpec", "get_format", "format_for_quant_method"]

# The formats whose layout module has the per-linear interface above (QuantLinear, the integer writer).
# What each format can store is declared by its class in `quantkit.formats.registry` (GGUF and the float
# layouts included); the layout modules refuse schemes through those declarations.
FORMATS = ("gptq", "compressed-tensors", "awq")


def get_format(name: str) -> ModuleType:
    """The layout module of format `name` ("gptq", "compressed-tensors", "awq"), from the registry."""
    from quantkit.formats import registry

    key = str(name).lower().replace("_", "-")
    if key not in FORMATS:
        raise QuantkitError(f"unknown checkpoint format {name!r}; choose one of {', '.join(FORMATS)}")
    return registry.get(key).module()


def format_for_quant_method(qcfg: dict) -> ModuleType:
    """The layout module that reads a config.json quantization_config (by its quant_method)."""
    method = str((qcfg or {}).get("quant_method", "")).lower()
    if method not in FORMATS:
        raise QuantkitError(f"unsupported quant_method {method!r}; quantkit reads {', '.join(FORMATS)}")
    return get_format(method)
