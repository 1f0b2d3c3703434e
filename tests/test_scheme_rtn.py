"""Scheme resolution rules and the RTN quantizer against a straightforward RTN written here."""
import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.quantizers import get_quantizer
from quantkit.quantizers.grid import rtn_quantize
from quantkit.scheme import LinearScheme, QuantScheme, scheme_from_dict


def plain_rtn(w: torch.Tensor, bits: int, group: int, sym: bool) -> torch.Tensor:
    """Textbook RTN, one group at a time, with scales rounded to fp16 (the storage dtype)."""
    out = torch.empty_like(w)
    maxq = 2**bits - 1
    g = w.shape[1] if group == -1 else group
    for r in range(w.shape[0]):
        for c0 in range(0, w.shape[1], g):
            x = w[r, c0:c0 + g]
            lo, hi = min(x.min().item(), 0.0), max(x.max().item(), 0.0)
            if sym:
                a = max(-lo, hi)
                scale = 2 * a / maxq
                zero = (maxq + 1) // 2
            else:
                scale = (hi - lo) / maxq
            scale = float(torch.tensor(scale if scale > 0 else 1.0).half())
            if not sym:
                zero = min(max(round(-lo / scale), 0), maxq)
            q = torch.clamp(torch.round(x / scale) + zero, 0, maxq)
            out[r, c0:c0 + g] = (q - zero) * scale
    return out


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [32, 64, -1])
@pytest.mark.parametrize("sym", [True, False])
def test_rtn_matches_plain_rtn(bits, group, sym):
    torch.manual_seed(bits * 100 + group)
    w = torch.randn(12, 128) * 0.05
    w[0, :5] = 0.0  # a partly-zero row
    w[1] = 0.0  # an all-zero row
    qw = rtn_quantize(w, bits, group, sym)
    expected = plain_rtn(w, bits, group, sym)
    torch.testing.assert_close(qw.dequantize(), expected, rtol=0, atol=1e-7)
    assert int(qw.qweight.max()) <= 2**bits - 1
    assert qw.scales.shape == (12, 1 if group == -1 else 128 // group)


def test_rtn_plugin_uses_module_weight_and_bias():
    """mse=false is textbook RTN (the plain loop); the default searches each group's range, which
    never rounds worse than that."""
    lin = torch.nn.Linear(64, 16)
    scheme = LinearScheme(bits=4, group_size=32, sym=True)
    qw = get_quantizer("rtn", mse=False).quantize_linear("x", lin, scheme)
    plain = plain_rtn(lin.weight.data, 4, 32, True)
    torch.testing.assert_close(qw.dequantize(), plain, rtol=0, atol=1e-7)
    assert torch.equal(qw.bias, lin.bias.data)
    searched = get_quantizer("rtn").quantize_linear("x", lin, scheme)
    assert torch.equal(searched.bias, lin.bias.data)
    err = lambda deq: (deq - lin.weight.data).reshape(-1, 32).abs().pow(2.4).sum(1)  # noqa: E731
    assert bool((err(searched.dequantize()) <= err(plain) * (1 + 1e-5)).all())


def test_auto_group_size_and_errors():
    shapes = {"model.layers.0.mlp.up_proj": (1536, 576), "model.layers.0.mlp.down_proj": (576, 1536), "lm_head": (100, 576)}
    resolved = QuantScheme(bits=4).resolve(shapes)
    assert set(resolved) == {"model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"}  # lm_head ignored
    assert {s.group_size for s in resolved.values()} == {64}
    assert QuantScheme(bits=4).resolve({"a": (8, 256)})["a"].group_size == 128
    with pytest.raises(QuantkitError, match="group size 128 does not divide .*576"):
        QuantScheme(bits=4, group_size=128).resolve(shapes)
    with pytest.raises(QuantkitError, match="unsupported bits 5"):
        QuantScheme(bits=5)
    with pytest.raises(QuantkitError, match="unsupported group size"):
        QuantScheme(group_size=48)


def test_overrides_and_ignore_from_recipe_dict():
    scheme = scheme_from_dict({"bits": 4, "group_size": 32, "ignore": ["q_proj$"],
                               "overrides": [{"pattern": "down_proj$", "bits": 8, "group_size": -1, "sym": False}]})
    shapes = {"l.q_proj": (64, 64), "l.k_proj": (64, 64), "l.down_proj": (64, 128)}
    r = scheme.resolve(shapes)
    assert "l.q_proj" not in r
    assert r["l.k_proj"] == LinearScheme(4, 32, True)
    assert r["l.down_proj"] == LinearScheme(8, -1, False)
    with pytest.raises(QuantkitError, match="unknown scheme keys"):
        scheme_from_dict({"bitz": 4})


def test_unknown_method_lists_choices():
    with pytest.raises(QuantkitError, match="unknown method 'foo'; choose one of: .*rtn"):
        get_quantizer("foo")


def test_every_bundled_recipe_resolves_to_a_plan():
    """A recipe with a misspelt option, scheme or calibration key would only fail when a user runs it."""
    from importlib.resources import files

    from quantkit.plan import read_recipe_file, resolve_plan

    names = sorted(p.name[:-5] for p in files("quantkit.recipes").iterdir() if p.name.endswith(".yaml"))
    assert "awq-w4g64-demo" in names and "gptq-w4g64-demo" in names
    for name in names:
        plan = resolve_plan(recipe_file=name)
        options = read_recipe_file(name).get("options") or {}
        assert all(any(s.options.get(k) == v for s in plan.recipe.steps) for k, v in options.items()), name


def test_rtn_mse_takes_each_groups_lowest_error_range():
    """--method rtn (mse, the default): per group, the range the coarse-to-fine search picks (the
    shrink of the min/max range with the lowest |w - q|^2.4 among the trials the search makes), within
    1 % in total of the brute-force best over all 80 shrinks, and never a wider range than plain RTN's."""
    from quantkit.quantizers.grid import compute_qparams, fake_quantize, find_qparams, rtn_quantize

    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(7)) * torch.linspace(0.1, 2, 128)
    plain, searched = rtn_quantize(w, 4, 32, True), rtn_quantize(w, 4, 32, True, mse=True)
    groups = w.reshape(-1, 32)
    best = torch.full([groups.shape[0]], float("inf"))
    for i in range(80):
        s, z = compute_qparams(groups, 4, True, clip_ratio=1 - i / 100)
        best = torch.minimum(best, (fake_quantize(groups, s, z, 4) - groups).abs().pow(2.4).sum(1))
    got = (searched.dequantize().reshape(-1, 32) - groups).abs().pow(2.4).sum(1)
    s, z = find_qparams(groups, 4, True, mse=True)
    torch.testing.assert_close(got, (fake_quantize(groups, s, z, 4) - groups).abs().pow(2.4).sum(1), rtol=1e-5, atol=0)
    assert bool((got >= best * (1 - 1e-5)).all()) and float(got.sum()) <= 1.01 * float(best.sum())
    plain_err = (plain.dequantize().reshape(-1, 32) - groups).abs().pow(2.4).sum(1)
    assert bool((got <= plain_err * (1 + 1e-5)).all()) and float(got.sum()) < 0.95 * float(plain_err.sum())
    assert bool((searched.scales <= plain.scales).all()) and bool((searched.scales < plain.scales).any())
