"""Float grids (#47) against the format definitions (a brute-force E2M1 reference written here) and against
compressed-tensors' own quantization functions (the oracle; quantkit never imports compressed-tensors)."""
import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.float_codecs import e2m1, e4m3, e8m0, fp8, mxfp4, nvfp4

ct_args = pytest.importorskip("compressed_tensors.quantization.quant_args")
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize  # noqa: E402
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales  # noqa: E402

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def reference_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest of the 8 magnitudes by brute force, ties to the even index, sign bit from the input."""
    a = x.abs().clamp(max=6.0).unsqueeze(-1)
    dist = (a - GRID).abs()
    best = dist.min(dim=-1, keepdim=True).values
    tied = dist == best
    # among tied candidates prefer the even index (there are at most two, adjacent)
    index = torch.where(tied[..., :].float().sum(-1) > 1,
                        (tied * (torch.arange(8) % 2 == 0)).float().argmax(-1),
                        dist.argmin(-1))
    return index.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def _weight(n=48, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3, 17] = 0.9  # an outlier, so groups' scales differ widely
    w[5, :32] = 0.0  # an all-zero group
    return w


def test_e2m1_codes_decode_to_the_sixteen_values_and_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1.decode(codes)
    assert values[:8].tolist() == GRID.tolist()
    assert values[8:].tolist() == (-GRID).tolist()
    assert torch.equal(e2m1.encode(values), codes)  # -0.0 keeps code 8


def test_e2m1_rounding_matches_brute_force_reference_and_compressed_tensors():
    g = torch.Generator().manual_seed(1)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.5, 100.0])
    x = torch.cat([torch.randn(4000, generator=g) * 3, midpoints, -midpoints, GRID, -GRID])
    ours = e2m1.encode(x)
    assert torch.equal(ours, reference_e2m1_codes(x))
    ct = ct_args.FP4_E2M1_DATA.cast_to_fp4(x.clamp(-6, 6).clone())
    assert torch.equal(e2m1.decode(ours), ct)
    # ties to even: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    assert e2m1.decode(e2m1.encode(midpoints[:7])).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_bulk_e2m1_rounding_matches_the_brute_force_reference():
    g = torch.Generator().manual_seed(2)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.5, 100.0, 1e-30, 0.0])
    a = torch.cat([torch.randn(20000, generator=g).abs() * 3, midpoints, GRID])
    expected = GRID[(reference_e2m1_codes(a) & 7).long()]
    assert torch.equal(e2m1.round_magnitudes_(a.clone()), expected)


def test_nvfp4_activation_rounding_is_the_codecs_round_trip():
    """The bulk path a runtime's (and GPTQ's) W4A4 input rounding takes equals quantize + dequantize bit for
    bit: ties, zero groups, signed zeros, values beyond the global scale's range, more rows than one chunk."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(e2m1.FAKE_QUANTIZE_ROWS * 2 + 5, 96, generator=g) * 2
    x[0, :16] = 0.0
    x[1, :16] = -0.0
    x[2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * torch.tensor(0.5)
    x[3, 5] = 1e4  # past the calibrated range: saturates as the codec does
    gscale = nvfp4.global_scale(x[4:])  # calibrated on other rows than the outlier's
    expected = nvfp4.quantize(x, gscale=gscale).dequantize()
    got = nvfp4.fake_quantize(x, gscale)
    assert torch.equal(got, expected)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))
    # one global scale per row: each row as the codec rounds it alone
    per_row = nvfp4.fake_quantize(x, nvfp4.row_global_scales(x))
    for i in (0, 3, 7, x.shape[0] - 1):
        assert torch.equal(per_row[i], nvfp4.quantize(x[i:i + 1]).dequantize()[0])


def test_mxfp4_activation_rounding_is_the_codecs_round_trip():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(e2m1.FAKE_QUANTIZE_ROWS + 7, 96, generator=g) * 3
    x[0, :32] = 0.0
    x[1, :32] = -0.0
    x[2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # ties under a scale of 1
    x[2, 16:32] = 0.1
    x[3, 40] = 1e30  # a huge group: its exponent, others' unchanged
    x[4, 64:96] = 1e-40  # subnormal inputs
    got, expected = mxfp4.fake_quantize(x), mxfp4.quantize(x).dequantize()
    assert torch.equal(got, expected)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))


def test_e4m3_saturates_instead_of_nan():
    out = e4m3.to_e4m3(torch.tensor([1000.0, -1000.0, 448.0, 0.1]))
    assert out.to(torch.float32).tolist()[:3] == [448.0, -448.0, 448.0]
    assert not torch.isnan(out.to(torch.float32)).any()


def test_e8m0_exponents_match_compressed_tensors():
    g = torch.Generator().manual_seed(2)
    powers = 2.0 ** torch.arange(-30, 30, dtype=torch.float32)
    amax = torch.cat([torch.rand(5000, generator=g) * 10.0 ** torch.randint(-8, 8, (5000,), generator=g),
                      powers, powers * 1.75, powers * 1.7499, powers * 1.5, torch.tensor([0.0, 1e-40])])
    ct = generate_mx_scales(amax, num_bits=4).clamp(0, 255).round()
    assert torch.equal(e8m0.shared_exponent_codes(amax).to(torch.float32), ct)
    codes = torch.arange(0, 255, dtype=torch.uint8)
    assert torch.equal(e8m0.decode(codes), 2.0 ** (codes.to(torch.float64) - 127).to(torch.float32))
    assert e8m0.decode(torch.tensor([0], dtype=torch.uint8)).item() == 2.0 ** -127
    assert torch.isnan(e8m0.decode(torch.tensor([255], dtype=torch.uint8))).all()


@pytest.mark.parametrize("preset, strategy, block", [("FP8", "tensor", None), ("FP8_DYNAMIC", "channel", None),
                                                     ("FP8_BLOCK", "block", (128, 128))])
@pytest.mark.parametrize("shape", [(48, 256), (200, 300)])
def test_fp8_matches_compressed_tensors(preset, strategy, block, shape):
    w = _weight(*shape) if shape[1] % 32 == 0 else torch.randn(*shape) * 0.02
    args = PRESET_SCHEMES[preset]["weights"]
    q = fp8.quantize(w, strategy, block)
    if strategy == "tensor":
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    elif strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        nb, kb = -(-shape[0] // 128), -(-shape[1] // 128)
        padded = torch.nn.functional.pad(w, (0, kb * 128 - shape[1], 0, nb * 128 - shape[0]))
        blocks = padded.reshape(nb, 128, kb, 128)
        lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    ct_scale, _ = calculate_qparams(lo, hi, args)
    assert torch.equal(q.scale, ct_scale.reshape(q.scale.shape))
    ct_values = ct_quantize(w, ct_scale, None, args, dtype=torch.float8_e4m3fn)
    assert q.values.dtype == torch.float8_e4m3fn
    assert torch.equal(q.values.view(torch.uint8), ct_values.view(torch.uint8))
    assert torch.equal(q.dequantize(), ct_dequantize(ct_values, ct_scale, args=args, dtype=torch.float32))
    assert (q.dequantize() - w).abs().max() < w.abs().max() / 16  # E4M3 keeps 3 mantissa bits


def test_nvfp4_matches_compressed_tensors():
    w = _weight()
    args = PRESET_SCHEMES["NVFP4A16"]["weights"]
    q = nvfp4.quantize(w)
    ct_global = generate_gparam(w.amin(), w.amax())
    assert torch.equal(q.global_scale, ct_global)
    groups = w.reshape(48, 16, 16)
    ct_scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=ct_global)
    assert q.group_scale.dtype == torch.float8_e4m3fn
    assert torch.equal(q.group_scale.to(torch.float32), ct_scale)
    ct_values = ct_quantize(w, ct_scale, None, args, global_scale=ct_global)
    assert torch.equal(e2m1.decode(q.codes), ct_values)
    ct_w = ct_dequantize(ct_values, ct_scale, args=args, global_scale=ct_global, dtype=torch.float32)
    assert torch.equal(q.dequantize(), ct_w)
    assert torch.equal(q.dequantize()[5, :32], torch.zeros(32))


def test_mxfp4_matches_compressed_tensors():
    w = _weight()
    args = PRESET_SCHEMES["MXFP4A16"]["weights"]
    q = mxfp4.quantize(w)
    groups = w.reshape(48, 8, 32)
    ct_scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    assert torch.equal(e8m0.decode(q.scale_codes), ct_scale)
    ct_values = ct_quantize(w, ct_scale, None, args)
    assert torch.equal(e2m1.decode(q.codes), ct_values)
    assert torch.equal(q.dequantize(), ct_dequantize(ct_values, ct_scale, args=args, dtype=torch.float32))


@pytest.mark.parametrize("codec, group", [(nvfp4, 16), (mxfp4, 32)])
def test_fp4_dequantized_weight_is_the_nearest_grid_point_of_its_group(codec, group):
    """The definition, checked directly: each element is the scaled grid value nearest to it (saturating)."""
    w = _weight(seed=3)
    q = codec.quantize(w)
    deq = q.dequantize().reshape(48, -1, group)
    if codec is nvfp4:
        step = (q.group_scale.to(torch.float32) / q.global_scale).unsqueeze(-1)
    else:
        step = e8m0.decode(q.scale_codes).unsqueeze(-1)
    candidates = torch.cat([GRID, -GRID]) * step.unsqueeze(-1)  # [N, G, 1, 16]
    nearest_dist = (w.reshape(48, -1, group).unsqueeze(-1) - candidates).abs().min(-1).values
    assert torch.allclose((deq - w.reshape(48, -1, group)).abs(), nearest_dist, rtol=1e-6, atol=0)
    # E4M3 rounds NVFP4's group scale to nearest, so a group's max may sit past 6 steps and saturate there


def test_grouped_shapes_are_checked():
    with pytest.raises(QuantkitError, match="multiple of 16"):
        nvfp4.quantize(torch.zeros(4, 24))
    with pytest.raises(QuantkitError, match="multiple of 32"):
        mxfp4.quantize(torch.zeros(4, 48))
    with pytest.raises(QuantkitError, match="needs a block size"):
        fp8.quantize(torch.zeros(4, 48), "block")
