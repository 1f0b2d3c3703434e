"""The range search of the float grids' scales (#47 item 3, `float_codecs.scale_search`): never a larger weight
error than the absmax rule, every chosen scale one the format can store, the choice equal to a brute-force
search written here (float64, one region at a time, the absmax scale from compressed-tensors' own functions),
and a searched checkpoint decompressed by compressed-tensors exactly as quantkit's loader reads it."""
import pytest
import torch

import quantkit
from quantkit.errors import QuantkitError
from quantkit.float_checkpoint import write
from quantkit.float_codecs import e2m1, e4m3, e8m0, fp8, mxfp4, nvfp4, scale_search
from quantkit.scheme_presets import preset

pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales  # noqa: E402
from test_float_runtime import ct_decompressed  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

# every finite positive E4M3 value, in code order (torch's own float8 decoding of the 126 bytes)
E4M3_VALUES = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)


def _weight(n=24, k=128, seed=0):
    """Heavy-tailed rows (as trained weights are) with an outlier and an all-zero group."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1
    w = w * (1 + 3 * (torch.rand(n, k, generator=g) > 0.97))
    w[3, 17] = 0.9
    w[5, :32] = 0.0
    return w


def _error(w: torch.Tensor, w_hat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Squared error per (rows x cols) region of [N, K] (float64)."""
    d = (w.double() - w_hat.double()).square()
    n, k = d.shape
    return d.reshape(n // rows, rows, k // cols, cols).sum(dim=(1, 3))


CASES = {  # name: (quantize(w, search), region rows, region cols, whether this weight's total error must drop)
    "nvfp4": (lambda w, s: nvfp4.quantize(w, search=s), 1, 16, True),
    "mxfp4": (lambda w, s: mxfp4.quantize(w, search=s), 1, 32, True),
    "fp8-channel": (lambda w, s: fp8.quantize(w, "channel", search=s), 1, 128, True),
    "fp8-block": (lambda w, s: fp8.quantize(w, "block", (8, 32), search=s), 8, 32, True),
    # one scale for the tensor: E4M3's relative step is the same at any scale, so clipping rarely pays
    "fp8-tensor": (lambda w, s: fp8.quantize(w, "tensor", search=s), 24, 128, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_search_never_raises_a_regions_error_and_lowers_the_total(case):
    quantize, rows, cols, must_drop = CASES[case]
    w = _weight()
    plain, searched = (_error(w, quantize(w, s).dequantize(), rows, cols) for s in (False, True))
    assert bool((searched <= plain).all())
    if must_drop:
        assert float(searched.sum()) < 0.995 * float(plain.sum()), (float(searched.sum()), float(plain.sum()))


def _best(group: torch.Tensor, steps, grid_round, weights=None) -> int:
    """Index of the step with the lowest float64 squared error of `group` rounded under it (first on a tie),
    each element's error times `weights` when given."""
    weights = torch.ones_like(group) if weights is None else weights.double()
    errors = [float(((grid_round(group / s) * s - group).square() * weights).sum()) for s in steps]
    return min(range(len(errors)), key=lambda i: (errors[i], i)), errors


def _e2m1_round(x: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(e2m1.MAGNITUDES, dtype=torch.float64)
    a = x.abs().clamp(max=6.0)
    return torch.sign(x) * grid[(a.unsqueeze(-1) - grid).abs().argmin(-1)]


@pytest.mark.parametrize("weighted", [False, True])
def test_nvfp4_group_scales_are_e4m3_values_a_brute_force_search_picks(weighted):
    """Also with each element's error weighted by its column's importance (GPTQ's Hessian diagonal)."""
    w = _weight()
    ct = PRESET_SCHEMES["NVFP4A16"]["weights"]
    gscale = generate_gparam(w.amin(), w.amax())
    groups = w.reshape(w.shape[0], -1, 16)
    absmax_scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), ct, global_scale=gscale)
    importance = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(1)) ** 4 * 10 if weighted else None
    col_weights = None if importance is None else importance.reshape(-1, 16)
    q = nvfp4.quantize(w, search=True, importance=importance)
    assert q.group_scale.dtype == torch.float8_e4m3fn and torch.equal(q.global_scale, gscale.reshape(1))
    chosen = q.group_scale.to(torch.float64)
    g64, gs = groups.double(), float(gscale)
    for r in range(groups.shape[0]):
        for c in range(groups.shape[1]):
            base = int((E4M3_VALUES == float(absmax_scale[r, c])).nonzero()) if float(absmax_scale[r, c]) > 0 else None
            if base is None or not bool(g64[r, c].any()):
                continue  # an all-zero group: nothing to search, its scale is the absmax rule's
            candidates = [E4M3_VALUES[min(max(base + d, 0), len(E4M3_VALUES) - 1)] for d in scale_search.NVFP4_CODE_OFFSETS]
            best, errors = _best(g64[r, c], [float(s) / gs for s in candidates], _e2m1_round,
                                 None if col_weights is None else col_weights[c])
            mine = errors[[float(s) for s in candidates].index(float(chosen[r, c]))]
            assert float(chosen[r, c]) in E4M3_VALUES.tolist()
            assert mine <= errors[best] * (1 + 1e-9) + 1e-30, (r, c, mine, errors[best])
    assert bool((chosen != absmax_scale.double()).any())  # the search moved some groups' scales


def test_mxfp4_exponents_are_e_or_e_minus_1_as_a_brute_force_search_picks():
    w = _weight()
    groups = w.reshape(w.shape[0], -1, 32)
    # compressed-tensors' absmax exponent code (-inf for an all-zero group, which quantkit stores as code 0)
    e = generate_mx_scales(groups.abs().amax(-1)).nan_to_num(neginf=0).to(torch.int64)
    q = mxfp4.quantize(w, search=True)
    assert q.scale_codes.dtype == torch.uint8
    chosen = q.scale_codes.to(torch.int64)
    assert bool(((chosen == e) | (chosen == e - 1)).all())
    g64 = groups.double()
    for r in range(groups.shape[0]):
        for c in range(groups.shape[1]):
            if not bool(g64[r, c].any()):
                assert int(chosen[r, c]) == int(e[r, c])
                continue
            steps = [2.0 ** (int(e[r, c]) - 127), 2.0 ** (int(e[r, c]) - 1 - 127)]
            best, errors = _best(g64[r, c], steps, _e2m1_round)
            assert errors[int(e[r, c] - chosen[r, c])] <= errors[best] * (1 + 1e-9), (r, c, errors)
    assert bool((chosen != e).any())


def test_fp8_scales_are_clip_ratios_of_the_channel_absmax():
    w = _weight()
    q = fp8.quantize(w, "channel", search=True)
    amax = w.abs().amax(dim=1, keepdim=True)
    candidates = torch.stack([torch.where(amax * p == 0, torch.finfo(torch.float32).eps, amax * p / 448.0)
                              for p in scale_search.FP8_CLIP_RATIOS])
    assert bool((q.scale.unsqueeze(0) == candidates).any(dim=0).all())
    e4m3_round = lambda y: y.clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float64)  # noqa: E731
    for r in range(w.shape[0]):
        best, errors = _best(w[r].double(), [float(s[r]) for s in candidates], e4m3_round)
        mine = errors[int((candidates[:, r, 0] == q.scale[r, 0]).nonzero()[0])]
        assert mine <= errors[best] * (1 + 1e-9), (r, mine, errors[best])


@pytest.mark.parametrize("name", ["NVFP4A16", "MXFP4A16", "FP8_DYNAMIC", "FP8_BLOCK"])
def test_searched_checkpoint_decompresses_through_compressed_tensors_as_quantkit_loads_it(tmp_path, name):
    def model():
        return tiny_model("llama", hidden_size=128, intermediate_size=256)

    from quantkit.float_checkpoint import read_dequantized

    write(model(), preset(name), tmp_path / "mse", options={"mse": True})
    write(model(), preset(name), tmp_path / "plain", options={"mse": False})
    ours, plain = read_dequantized(tmp_path / "mse"), read_dequantized(tmp_path / "plain")
    assert any(not torch.equal(ours[m], plain[m]) for m in ours)  # the search changed some weights
    decompressed = ct_decompressed(tmp_path / "mse")
    loaded = quantkit.load(tmp_path / "mse")
    assert sorted(decompressed) == sorted(ours)
    for module_name, w in ours.items():
        assert torch.equal(decompressed[module_name], w), module_name
        assert torch.equal(loaded.get_submodule(module_name).dequantized_weight(), w), module_name


def test_the_default_follows_the_format_and_a_bad_value_is_refused(tmp_path):
    w = _weight()
    for family, quantize in (("nvfp4", nvfp4.quantize), ("mxfp4", mxfp4.quantize)):
        from quantkit.float_checkpoint import quantize_weight

        name = "NVFP4A16" if family == "nvfp4" else "MXFP4A16"
        _, by_default = quantize_weight(w, preset(name))
        assert torch.equal(by_default, quantize(w, search=scale_search.DEFAULT_ON[family]).dequantize())
    with pytest.raises(QuantkitError, match="mse='yes' must be true or false"):
        write(tiny_model("llama", hidden_size=128, intermediate_size=256), preset("NVFP4A16"), tmp_path / "m",
              options={"mse": "yes"})
    assert not (tmp_path / "m").exists()


def test_the_searchs_e2m1_rounding_is_as_far_as_the_encoders_everywhere_ties_included():
    y = torch.cat([torch.linspace(-8, 8, 20001), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 7.0])])
    exact = (e2m1.decode(e2m1.encode(y)) - y).abs()
    assert torch.equal((scale_search.e2m1_magnitude(y) - y.abs()).abs(), exact)


WEIGHTED_CASES = {  # name: (quantize(w, importance), candidate steps per region [T, regions...] as float64 lists)
    "nvfp4": (lambda w, imp: nvfp4.quantize(w, search=True, importance=imp), 1, 16),
    "mxfp4": (lambda w, imp: mxfp4.quantize(w, search=True, importance=imp), 1, 32),
    "fp8-channel": (lambda w, imp: fp8.quantize(w, "channel", search=True, importance=imp), 1, 128),
    "fp8-block": (lambda w, imp: fp8.quantize(w, "block", (8, 32), search=True, importance=imp), 8, 32),
}


@pytest.mark.parametrize("case", sorted(WEIGHTED_CASES))
def test_weighted_search_keeps_each_regions_lowest_weighted_error(case):
    """With `importance` (GPTQ's Hessian diagonal, one weight per input column), each region's scale is the
    candidate with the lowest importance-weighted squared error: checked in float64 against every other
    candidate the unweighted search could pick (the union over all-ones and the weighted choices), and
    all-ones weights choose exactly as the unweighted search does."""
    quantize, rows, cols = WEIGHTED_CASES[case]
    w = _weight()
    importance = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(1)) ** 4 * 10
    plain = quantize(w, None).dequantize()
    assert torch.equal(quantize(w, torch.ones(w.shape[1])).dequantize(), plain)
    weighted = quantize(w, importance).dequantize()
    assert not torch.equal(weighted, plain)  # the weights moved some regions' scales

    def weighted_error(w_hat):
        d = (w.double() - w_hat.double()).square() * importance.double()
        n, k = d.shape
        return d.reshape(n // rows, rows, k // cols, cols).sum(dim=(1, 3))

    # every region's weighted error is at most the unweighted choice's (both are candidates of the search)
    assert bool((weighted_error(weighted) <= weighted_error(plain) * (1 + 1e-9) + 1e-30).all())
    assert float(weighted_error(weighted).sum()) < float(weighted_error(plain).sum())


def test_importance_of_the_wrong_width_is_refused():
    with pytest.raises(QuantkitError, match="does not fit"):
        nvfp4.quantize(_weight(), search=True, importance=torch.ones(64))
