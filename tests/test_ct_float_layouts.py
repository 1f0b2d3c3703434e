"""compressed-tensors float layouts (#47): pack/unpack round trips, and compressed-tensors' own compressors
(the oracle) writing the same bytes from quantkit's scales and decompressing quantkit's tensors to the same
weights quantkit dequantizes."""
import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.float_codecs import e8m0, fp8, mxfp4, mxfp8, nvfp4
from quantkit.formats import ct_float_quantized, ct_mxfp4, ct_mxfp8, ct_nvfp4, fp4_nibbles

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.mxfp8 import MXFP8QuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.naive_quantized import FloatQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8  # noqa: E402
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme  # noqa: E402


def _weight(n=64, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.04
    w[7, 100] = -0.7
    w[9, :32] = 0.0
    return w


def test_nibble_order_matches_compressed_tensors():
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    from quantkit.float_codecs import e2m1
    assert torch.equal(fp4_nibbles.pack(codes), pack_fp4_to_uint8(e2m1.decode(codes)))
    assert torch.equal(fp4_nibbles.unpack(fp4_nibbles.pack(codes)), codes)
    assert fp4_nibbles.pack(torch.tensor([[1, 2]], dtype=torch.uint8)).item() == 0x21


def test_nvfp4_round_trip_and_compressed_tensors_agree():
    w = _weight()
    q = nvfp4.quantize(w)
    tensors = ct_nvfp4.pack(q)
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == {
        "weight_packed": ((64, 128), torch.uint8), "weight_scale": ((64, 16), torch.float8_e4m3fn),
        "weight_global_scale": ((1,), torch.float32)}
    back = ct_nvfp4.unpack(tensors, (64, 256))
    assert torch.equal(back.codes, q.codes) and torch.equal(back.global_scale, q.global_scale)
    assert torch.equal(back.group_scale.view(torch.uint8), q.group_scale.view(torch.uint8))

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    ct_written = NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": q.group_scale.to(torch.float32), "weight_global_scale": q.global_scale},
        scheme)
    assert torch.equal(ct_written["weight_packed"], tensors["weight_packed"])
    assert torch.equal(ct_written["weight_scale"].view(torch.uint8), tensors["weight_scale"].view(torch.uint8))

    ct_read = NVFP4PackedCompressor.decompress(dict(tensors), scheme)["weight"]
    assert ct_read.dtype == torch.bfloat16
    assert torch.equal(ct_read, back.dequantize(torch.bfloat16))


def test_mxfp4_round_trip_and_compressed_tensors_agree():
    w = _weight(seed=1)
    q = mxfp4.quantize(w)
    tensors = ct_mxfp4.pack(q)
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == {
        "weight_packed": ((64, 128), torch.uint8), "weight_scale": ((64, 8), torch.uint8)}
    back = ct_mxfp4.unpack(tensors, (64, 256))
    assert torch.equal(back.codes, q.codes) and torch.equal(back.scale_codes, q.scale_codes)

    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    ct_written = MXFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": e8m0.decode(q.scale_codes)}, scheme)
    assert torch.equal(ct_written["weight_packed"], tensors["weight_packed"])
    assert torch.equal(ct_written["weight_scale"], tensors["weight_scale"])

    ct_read = MXFP4PackedCompressor.decompress(dict(tensors), scheme)["weight"]
    assert torch.equal(ct_read, back.dequantize(torch.bfloat16))


def test_mxfp8_follows_its_definition_and_compressed_tensors_agree():
    w = _weight(seed=3)
    w[3, 64:96] = 1.76 * 2.0 ** -3  # a group max whose mantissa is past 1.75: its exponent rounds up
    w[4, 64:96] = 1.74 * 2.0 ** -3  # and one just below: it does not
    q = mxfp8.quantize(w)
    # the definition in plain PyTorch: the group max rounded to a power of two (mantissa 1.75 or more rounds
    # up), minus E4M3's top exponent 8; elements E4M3 of w / 2**e
    amax = w.reshape(64, 8, 32).abs().amax(-1).double()
    mantissa, exponent = torch.frexp(amax)
    power = exponent - 1 + (2 * mantissa >= 1.75).long()
    want_codes = torch.where(amax > 0, power - 8 + 127, torch.zeros_like(power))
    assert torch.equal(q.scale_codes.long(), want_codes)
    assert int(q.scale_codes[3, 2]) == int(q.scale_codes[4, 2]) + 1
    scale = torch.pow(2.0, want_codes.double() - 127).repeat_interleave(32, dim=1)
    want = (w.double() / scale).float().clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.values.view(torch.uint8), want.view(torch.uint8))
    assert float((w.double() / scale).abs().max()) < 448  # the rule never needs the clamp at +-448
    # compressed-tensors' own scale rule (generate_mx_scales for 8-bit elements) gives the same exponents
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales
    theirs = generate_mx_scales(w.reshape(64, 8, 32).abs().amax(-1), num_bits=8)
    nonzero = amax > 0
    assert torch.equal(theirs[nonzero].long(), q.scale_codes[nonzero].long())

    tensors = ct_mxfp8.pack(q)
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == {
        "weight": ((64, 256), torch.float8_e4m3fn), "weight_scale": ((64, 8), torch.uint8)}
    back = ct_mxfp8.unpack(tensors, (64, 256))
    assert torch.equal(back.values.view(torch.uint8), q.values.view(torch.uint8))
    assert torch.equal(back.scale_codes, q.scale_codes)

    scheme = preset_name_to_scheme("MXFP8A16", ["Linear"])
    ct_written = MXFP8QuantizationCompressor.compress({"weight": w, "weight_scale": e8m0.decode(q.scale_codes)}, scheme)
    assert torch.equal(ct_written["weight"].view(torch.uint8), tensors["weight"].view(torch.uint8))
    assert torch.equal(ct_written["weight_scale"], tensors["weight_scale"])
    ct_read = MXFP8QuantizationCompressor.decompress(dict(tensors), scheme)["weight"]
    assert torch.equal(ct_read.float(), back.dequantize())  # E4M3 times a power of two: exact in bfloat16
    with pytest.raises(QuantkitError, match="MXFP8 has no range search"):
        mxfp8.quantize(w, search=True)


@pytest.mark.parametrize("preset, strategy, block, shape", [
    ("FP8", "tensor", None, (64, 256)), ("FP8_DYNAMIC", "channel", None, (64, 256)),
    ("FP8_BLOCK", "block", (128, 128), (64, 256)), ("FP8_BLOCK", "block", (128, 128), (200, 300))])
def test_fp8_round_trip_and_compressed_tensors_agree(preset, strategy, block, shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 0.03
    q = fp8.quantize(w, strategy, block)
    tensors = ct_float_quantized.pack(q)
    back = ct_float_quantized.unpack(tensors, shape, strategy, block)
    assert torch.equal(back.values.view(torch.uint8), q.values.view(torch.uint8))
    assert torch.equal(back.scale, q.scale)

    scheme = preset_name_to_scheme(preset, ["Linear"])
    ct_written = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": q.scale}, scheme)
    assert torch.equal(ct_written["weight"].view(torch.uint8), tensors["weight"].view(torch.uint8))

    ct_read = FloatQuantizationCompressor.decompress(dict(tensors), scheme)["weight"]
    assert torch.equal(ct_read, back.dequantize(torch.float32))


def test_tensors_that_disagree_with_the_config_are_refused_in_one_line():
    tensors = ct_nvfp4.pack(nvfp4.quantize(_weight()))
    with pytest.raises(QuantkitError, match=r"weight_packed is torch.uint8 \(64, 128\), expected torch.uint8 "
                                            r"\(64, 64\)"):
        ct_nvfp4.unpack(tensors, (64, 128))
    bad = dict(tensors, weight_scale=tensors["weight_scale"].to(torch.float32))
    with pytest.raises(QuantkitError, match="weight_scale is torch.float32"):
        ct_nvfp4.unpack(bad, (64, 256))
    with pytest.raises(QuantkitError, match="lacks weight_scale"):
        ct_mxfp4.unpack({"weight_packed": tensors["weight_packed"]}, (64, 256))
    with pytest.raises(QuantkitError, match="per tensor, channel or block, not 'group'"):
        ct_float_quantized.unpack({}, (64, 256), "group")


def test_each_layout_says_which_presets_it_can_store():
    from quantkit.scheme_presets import PRESETS

    stores = {mod.FORMAT: sorted(n for n, p in PRESETS.items() if mod.can_store(p.weights)[0])
              for mod in (ct_float_quantized, ct_mxfp8, ct_nvfp4, ct_mxfp4)}
    assert stores == {"float-quantized": ["FP8", "FP8_BLOCK", "FP8_DYNAMIC"],
                      "mxfp8-quantized": ["MXFP8", "MXFP8A16"],
                      "nvfp4-pack-quantized": ["NVFP4", "NVFP4A16"],
                      "mxfp4-pack-quantized": ["MXFP4", "MXFP4A16", "MXFP4XFP8"]}
    ok, reason = ct_mxfp8.can_store(PRESETS["FP8_BLOCK"].weights)
    assert not ok and reason == ("mxfp8-quantized stores FP8 (E4M3) weights in groups of 32 with E8M0 scales, not "
                                 "float 8-bit block group None scale None")
    ok, reason = ct_mxfp4.can_store(PRESETS["NVFP4A16"].weights)
    assert not ok and reason.startswith("mxfp4-pack-quantized stores FP4 (E2M1) weights in groups of 32")
    assert ct_float_quantized.can_store(PRESETS["W4AFP8"].weights) == (
        False, "float-quantized stores FP8 (E4M3) weights, not int 4-bit")
