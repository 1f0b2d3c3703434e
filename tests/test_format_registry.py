"""The format registry (#47): each format declares what it stores, and refusals are those declarations."""
import pytest

from quantkit.errors import QuantkitError
from quantkit.formats import get_format, registry
from quantkit.formats.spec import LinearSpec
from quantkit.scheme_presets import PRESETS, QuantArgs, SchemePreset, preset


def test_every_writable_format_is_a_registered_class():
    for name in registry.WRITABLE:
        fmt = registry.get(name.upper().replace("-", "_"))  # --format spellings
        assert isinstance(fmt, registry.CheckpointFormat) and fmt.name == name
    with pytest.raises(QuantkitError, match="unknown checkpoint format 'exl2'; choose one of gptq, compressed-tensors, awq, gguf"):
        registry.get("exl2")


@pytest.mark.parametrize("fmt,spec", [
    ("gptq", LinearSpec(64, 64, bits=5, group_size=32)),
    ("gptq", LinearSpec(64, 64, bits=8, input_quant="token")),
    ("awq", LinearSpec(64, 64, bits=3, group_size=32)),
    ("awq", LinearSpec(64, 64, bits=4, group_size=32, act_order="dynamic")),
    ("compressed-tensors", LinearSpec(64, 64, bits=4, group_size=32, act_order="dynamic")),
    ("compressed-tensors", LinearSpec(64, 64, bits=4, group_size=32, input_quant="token")),
])
def test_layout_modules_refuse_with_the_declared_reason(fmt, spec):
    ok, reason = registry.get(fmt).can_store(registry.scheme_of(spec), spec.act_order)
    assert not ok and reason
    with pytest.raises(QuantkitError) as err:
        get_format(fmt).packed_shapes(spec)
    assert str(err.value) == reason


def test_what_each_format_stores():
    stores = {name: {p for p, s in PRESETS.items() if registry.get(name).can_store(s)[0]} for name in registry.WRITABLE}
    # compressed-tensors holds every preset (W4AFP8: pack-quantized int4 weights under FP8 per-token inputs)
    assert stores["compressed-tensors"] == set(PRESETS)
    assert stores["gptq"] == {"W4A16", "W8A16"}
    assert stores["awq"] == {"W4A16"}
    assert stores["gguf"] == set()  # presets' groups of 128; llama.cpp's blocks are 32 (16, 256)
    w4afp8_static = SchemePreset("W4AFP8_STATIC", preset("W4AFP8").weights, QuantArgs("float", 8, "tensor"))
    ok, reason = registry.get("compressed-tensors").can_store(w4afp8_static)
    assert not ok and reason == ("compressed-tensors pack-quantized stores integer weights under FP8 dynamic per-token "
                                 "activations (W4AFP8), not float 8-bit per tensor dynamic=False")
    ok, reason = registry.get("compressed-tensors").can_store(preset("W4AFP8"), act_order="dynamic")
    assert not ok and reason == registry.CT_DYNAMIC_ACT_ORDER
    ok, reason = registry.get("gptq").can_store(preset("NVFP4A16"))
    assert not ok and "gptq stores integer weights, not float 4-bit" in reason
    ok, reason = registry.get("gguf").can_store(preset("MXFP4A16"))
    assert not ok and "llama.cpp's integer block types" in reason


def test_gguf_declares_llama_cpps_block_types():
    gguf = registry.get("gguf")
    for spec, want in ((LinearSpec(64, 64, bits=4, group_size=32), True),  # Q4_0
                       (LinearSpec(64, 64, bits=4, group_size=32, sym=False), True),  # Q4_1 / Q4_K
                       (LinearSpec(64, 64, bits=8, group_size=32), True),  # Q8_0
                       (LinearSpec(64, 64, bits=6, group_size=16), True),  # Q6_K
                       (LinearSpec(64, 64, bits=3, group_size=32), False),
                       (LinearSpec(64, 64, bits=4, group_size=128), False)):
        ok, reason = gguf.can_store(registry.scheme_of(spec))
        assert ok == want, (spec, reason)
        assert ok or "gguf has no llama.cpp type for" in reason


def test_float_layout_is_the_one_that_declares_the_preset():
    assert {n: registry.float_layout_for(preset(n)) for n in ("FP8", "FP8_BLOCK", "NVFP4", "MXFP4A16", "W4A16")} == {
        "FP8": "float-quantized", "FP8_BLOCK": "float-quantized", "NVFP4": "nvfp4-pack-quantized",
        "MXFP4A16": "mxfp4-pack-quantized", "W4A16": None}
