"""The checkpoint formats quantkit writes, each a registered class declaring what it can store.

Like vLLM's and GPTQModel's kernel registries: a format says, for a typed scheme, whether it can hold it
and if not why (`can_store(scheme, act_order) -> (ok, reason)`), and every refusal of a scheme by a format
comes from that declaration: the layout modules (`gptq`, `awq`, `compressed_tensors`, `ct_*`) call
`refuse_unless_stored` before packing or allocating, and `check(name, scheme)` is what a planner asks
before any calibration. Shape constraints of one linear (a group size that must divide its input
features, whole int32 words) stay with the layout module that packs it.

A scheme is `quantkit.scheme_presets.SchemePreset`: the weights' `QuantArgs` and, for W*A<16 schemes, the
input activations' (kind int/float, bits, strategy, group or block size, scale dtype, dynamic, symmetric);
`scheme_of(spec)` gives the one a `LinearSpec` (integer weights, int8 activations) describes. Act-order is
a property of how the columns were visited, not of the grid, so it is the separate `act_order` argument.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

from quantkit.errors import QuantkitError
from quantkit.formats.spec import LinearSpec
from quantkit.scheme_presets import QuantArgs, SchemePreset

Verdict = tuple[bool, str]
OK: Verdict = (True, "")

_INT8_ACTS = {"token": QuantArgs("int", 8, "token", dynamic=True), "tensor": QuantArgs("int", 8, "tensor")}


def scheme_of(spec: LinearSpec) -> SchemePreset:
    """The typed scheme of an integer `LinearSpec` (per channel when group_size is -1)."""
    if not 2 <= spec.bits <= 8:
        raise QuantkitError(f"integer grids are 2..8-bit, not {spec.bits}-bit")
    strategy = "channel" if spec.group_size == -1 else "group"
    weights = QuantArgs("int", spec.bits, strategy, group_size=None if spec.group_size == -1 else spec.group_size,
                        symmetric=spec.sym)
    acts = _INT8_ACTS[spec.input_quant] if spec.input_quant else None
    return SchemePreset("custom", weights, acts)


class CheckpointFormat:
    """One on-disk format. `name` is what --format / config.json's quant_method or format call it;
    `layout` the module that packs and unpacks it (None where the format is written by its own package)."""

    name: str = ""
    layout: Optional[str] = None

    def can_store(self, scheme: SchemePreset, act_order: str = "none") -> Verdict:
        raise NotImplementedError

    def module(self) -> ModuleType:
        if self.layout is None:
            raise QuantkitError(f"the {self.name} format has no per-linear layout module")
        return importlib.import_module(self.layout)


REGISTRY: dict[str, CheckpointFormat] = {}


def register(cls: type[CheckpointFormat]) -> type[CheckpointFormat]:
    REGISTRY[cls.name] = cls()
    return cls


def get(name: str) -> CheckpointFormat:
    """The registered format called `name` (case and _/- insensitive), or a one-line error listing them."""
    key = str(name).lower().replace("_", "-")
    if key not in REGISTRY:
        raise QuantkitError(f"unknown checkpoint format {name!r}; choose one of {', '.join(WRITABLE)}")
    return REGISTRY[key]


def check(name: str, scheme: SchemePreset, act_order: str = "none") -> None:
    """QuantkitError with the format's own reason unless format `name` stores `scheme`."""
    ok, reason = get(name).can_store(scheme, act_order)
    if not ok:
        raise QuantkitError(reason)


def refuse_unless_stored(name: str, spec: LinearSpec) -> None:
    """`check` for one integer linear, as the layout modules call it before packing or allocating."""
    check(name, scheme_of(spec), spec.act_order)


def _weight_only(name: str, scheme: SchemePreset) -> Optional[str]:
    if scheme.input_activations is not None:
        a = scheme.input_activations
        return (f"{name} stores weight-only schemes; {a.kind} {a.bits}-bit activations (W8A8, input_quant "
                f"{a.strategy!r}) need --format compressed-tensors")
    if scheme.weights.kind != "int":
        return f"{name} stores integer weights, not {scheme.weights.kind} {scheme.weights.bits}-bit; use --format compressed-tensors"
    if scheme.weights.strategy not in ("group", "channel"):
        return f"{name} stores integer weights per group or per channel, not per {scheme.weights.strategy}"
    return None


@register
class GptqFormat(CheckpointFormat):
    """GPTQ v1 (AutoGPTQ / GPTQModel / vLLM's gptq): packed int32 words, fp16 scales, a g_idx."""

    name, layout = "gptq", "quantkit.formats.gptq"
    BITS = (2, 3, 4, 8)

    def can_store(self, scheme, act_order="none"):
        refusal = _weight_only(self.name, scheme)
        if refusal:
            return False, refusal
        if scheme.weights.bits not in self.BITS:
            return False, f"gptq stores {self.BITS}-bit weights, not {scheme.weights.bits}-bit"
        return OK


@register
class AwqFormat(CheckpointFormat):
    """AutoAWQ's GEMM layout: 4-bit codes interleaved along the output dim, true zeros, no g_idx."""

    name, layout = "awq", "quantkit.formats.awq"

    def can_store(self, scheme, act_order="none"):
        refusal = _weight_only(self.name, scheme)
        if refusal:
            return False, refusal
        if scheme.weights.bits != 4:
            return False, f"awq (gemm) stores 4-bit weights only, not {scheme.weights.bits}-bit"
        if act_order == "dynamic":
            return False, "awq has no g_idx and cannot store dynamic act-order: use the gptq format"
        return OK


CT_DYNAMIC_ACT_ORDER = ("compressed-tensors cannot store dynamic act-order (a permuted g_idx; actorder 'group' "
                        "was removed in compressed-tensors 0.20): use the gptq format, or static_groups/"
                        "static act-order")


@register
class CompressedTensorsFormat(CheckpointFormat):
    """compressed-tensors: integer weights pack-quantized (W2..8A16, and W4AFP8 under FP8 per-token activations)
    or int-quantized (W8A8), and the float presets through the float layouts below (`float_layout_for`)."""

    name, layout = "compressed-tensors", "quantkit.formats.compressed_tensors"

    def can_store(self, scheme, act_order="none"):
        w, a = scheme.weights, scheme.input_activations
        if w.kind == "float":
            return (OK if float_layout_for(scheme) is not None else
                    (False, "; ".join(REGISTRY[n].can_store(scheme, act_order)[1] for n in FLOAT_LAYOUTS)))
        if a is not None and a.kind == "float":  # W4AFP8: pack-quantized int weights, FP8 dynamic per-token inputs
            if (a.bits, a.strategy, a.dynamic) != (8, "token", True):
                return False, (f"compressed-tensors pack-quantized stores integer weights under FP8 dynamic per-token "
                               f"activations (W4AFP8), not {a.kind} {a.bits}-bit per {a.strategy} dynamic={a.dynamic}")
            if w.strategy not in ("group", "channel") or not w.symmetric:
                return False, ("compressed-tensors W4AFP8 stores symmetric integer weights per group or channel, "
                               f"not {'symmetric' if w.symmetric else 'asymmetric'} per {w.strategy}")
            return (False, CT_DYNAMIC_ACT_ORDER) if act_order == "dynamic" else OK
        if a is not None:
            if a.kind != "int" or a.bits != 8 or a.strategy not in ("token", "tensor"):
                return False, (f"compressed-tensors int-quantized stores int8 per-token or per-tensor activations, "
                               f"not {a.kind} {a.bits}-bit per {a.strategy}")
            if (w.bits, w.strategy, w.symmetric, act_order) != (8, "channel", True, "none"):
                group = -1 if w.strategy == "channel" else w.group_size
                return False, ("compressed-tensors int-quantized (W8A8) stores 8-bit symmetric per-channel weights "
                               f"only, not bits={w.bits} group_size={group} sym={w.symmetric} act_order={act_order!r}")
            return OK
        if w.strategy not in ("group", "channel"):
            return False, f"compressed-tensors pack-quantized stores integer weights per group or channel, not per {w.strategy}"
        if act_order == "dynamic":
            return False, CT_DYNAMIC_ACT_ORDER
        return OK


class _FloatLayout(CheckpointFormat):
    """A compressed-tensors float layout: its module declares the weights it stores (`can_store(weights)`);
    the activations must be ones quantkit's runtime applies (`float_codecs.activations`)."""

    def can_store(self, scheme, act_order="none"):
        ok, reason = self.module().can_store(scheme.weights)
        if not ok:
            return False, reason
        if act_order != "none":
            return False, f"{self.name} stores no column order; act-order {act_order!r} cannot be recorded"
        if scheme.input_activations is not None:
            from quantkit.float_codecs.activations import check_supported

            try:
                check_supported(scheme.input_activations)
            except QuantkitError as exc:
                return False, str(exc)
        return OK


@register
class FloatQuantizedLayout(_FloatLayout):
    name, layout = "float-quantized", "quantkit.formats.ct_float_quantized"


@register
class Mxfp8Layout(_FloatLayout):
    name, layout = "mxfp8-quantized", "quantkit.formats.ct_mxfp8"


@register
class Nvfp4Layout(_FloatLayout):
    name, layout = "nvfp4-pack-quantized", "quantkit.formats.ct_nvfp4"


@register
class Mxfp4Layout(_FloatLayout):
    name, layout = "mxfp4-pack-quantized", "quantkit.formats.ct_mxfp4"


FLOAT_LAYOUTS = ("float-quantized", "mxfp8-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized")


def float_layout_for(scheme: SchemePreset) -> Optional[str]:
    """The compressed-tensors float layout that stores `scheme`, or None."""
    return next((n for n in FLOAT_LAYOUTS if REGISTRY[n].can_store(scheme)[0]), None)


@register
class GgufFormat(CheckpointFormat):
    """llama.cpp's GGUF (`quantkit.formats.gguf`): one llama.cpp tensor type per tensor, its blocks' grids
    fixed by ggml (`gguf.types.TYPES`), weight-only."""

    name = "gguf"

    def can_store(self, scheme, act_order="none"):
        from quantkit.formats.gguf.types import TYPES

        w = scheme.weights
        if scheme.input_activations is not None:
            return False, "gguf stores weight-only schemes; llama.cpp quantizes activations itself"
        if w.kind != "int":
            return False, f"gguf stores llama.cpp's integer block types, not {w.kind} {w.bits}-bit weights"
        matching = [t.name for t in TYPES.values() if t.quantized and t.bits == w.bits and t.group == w.group_size
                    and (t.zero is not None) == w.symmetric]
        if w.strategy != "group" or not matching:
            kinds = sorted({f"{t.bits}-bit groups of {t.group} {'sym' if t.zero is not None else 'asym'}"
                            for t in TYPES.values() if t.quantized})
            return False, (f"gguf has no llama.cpp type for {w.bits}-bit {'sym' if w.symmetric else 'asym'} "
                           f"{w.strategy} weights (group {w.group_size}); its types hold {', '.join(kinds)}")
        if act_order == "dynamic":
            return False, "gguf stores columns in order; dynamic act-order cannot be stored"
        return OK


WRITABLE = ("gptq", "compressed-tensors", "awq", "gguf")  # the --format values
