"""The full-range symmetric grid (`sym_range: full`, auto-round's `int_sym`): scale = signed absmax / 2**(b-1),
the group's largest-magnitude weight on code -2**(b-1), stored in the unchanged gptq / compressed-tensors layout
(codes 0..2**b - 1, zero 2**(b-1)) with a negative fp16 scale where the positive extreme dominates.

The oracles: auto-round 0.16.1's `quant_tensor_sym` transcribed in plain PyTorch, compressed-tensors'
own decompressor, and transformers' forward over the weights it decompressed."""
import pytest
import torch

import quantkit
from quantkit.errors import QuantkitError
from quantkit.formats import LinearSpec, get_format
from quantkit.quantizers.gptq import GPTQQuantizer
from quantkit.quantizers.gptq_core import gptq_quantize
from quantkit.quantizers.grid import MSE_NORM, rtn_quantize
from quantkit.runtime import QuantLinear


def autoround_int_sym(w: torch.Tensor, bits: int, gs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """auto-round 0.16.1's quant_tensor_sym (auto_round/data_type/int.py) with v = 0, min/max_scale = 1,
    fp16 scales: the dequantized weight [N, K] and the signed scales [N, K / gs]."""
    t = w.float().reshape(-1, gs)
    maxq = 2 ** (bits - 1)
    wmin_abs = -torch.clamp(t.min(-1)[0], max=0)
    wmax_abs = torch.clamp(t.max(-1)[0], min=0)
    max_v = (2 * (wmax_abs < wmin_abs).int() - 1) * torch.max(wmax_abs, wmin_abs)
    scale = (max_v / maxq).to(torch.float16)
    scale = torch.where(scale < 0, torch.clamp(scale, max=-1e-5), torch.clamp(scale, min=1e-5)).float().unsqueeze(-1)
    q = torch.clamp(torch.round(t / scale), -maxq, maxq - 1)
    return (scale * q).reshape(w.shape), scale.reshape(w.shape[0], -1)


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    """Heavy-tailed weights (a normal over the root of a uniform): groups dominated by a positive and by a
    negative outlier alike, as a trained layer's are."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) / torch.rand(n, k, generator=g).clamp_min(0.05).sqrt() * 0.02


@pytest.mark.parametrize("bits,gs", [(4, 64), (4, 32), (3, 32), (8, 128), (4, -1)])
def test_rtn_full_range_is_autorounds_int_sym(bits, gs):
    w = weights(48, 128, seed=bits * 100 + gs)
    qw = rtn_quantize(w, bits, gs, True, mse=False, sym_range="full")
    expected, scale = autoround_int_sym(w, bits, 128 if gs == -1 else gs)
    assert torch.equal(qw.dequantize(), expected)
    assert torch.equal(qw.scales.float(), scale)
    assert bool((qw.scales < 0).any()) and bool((qw.scales > 0).any())  # both orientations occur
    assert int(qw.qweight.min()) >= 0 and int(qw.qweight.max()) <= 2 ** bits - 1
    assert bool((qw.zeros == 2 ** (bits - 1)).all())
    # each group's largest-magnitude weight is stored as code 0 (i.e. -2**(b-1) around the zero)
    g = 128 if gs == -1 else gs
    dominant = w.reshape(-1, g).abs().argmax(dim=1, keepdim=True)
    assert bool((qw.qweight.reshape(-1, g).gather(1, dominant) == 0).all())


def test_mse_search_on_the_full_grid_never_loses_to_the_unsearched_full_grid():
    """The range search tries the unshrunk grid (shrink 1) among its candidates and keeps the lowest
    sum |error|**MSE_NORM per group, so it is never above auto-round's unsearched grid (the search
    evaluates |d|**norm as exp(norm*log|d|), a few ulp from pow: the 1e-5 relative slack)."""
    w = weights(64, 256, seed=7)
    searched = rtn_quantize(w, 4, 64, True, mse=True, sym_range="full").dequantize()
    plain, _ = autoround_int_sym(w, 4, 64)
    err = lambda d: (d - w).abs().pow(MSE_NORM).reshape(-1, 64).sum(dim=1)  # noqa: E731
    assert bool((err(searched) <= err(plain) * (1 + 1e-5)).all())
    assert bool((err(searched) < err(plain)).any())  # the search does move some groups


@pytest.mark.parametrize("act_order,static_groups", [(True, True), (False, False), (True, False)])
def test_gptq_on_the_full_grid_keeps_codes_in_range(act_order, static_groups):
    g = torch.Generator().manual_seed(3)
    w = weights(40, 128, seed=11)
    x = torch.randn(512, 128, generator=g)
    H = 2 * x.t() @ x / x.shape[0]
    qw, _ = gptq_quantize(w, H, 4, 32, True, act_order=act_order, static_groups=static_groups, mse=False,
                          sym_range="full")
    assert int(qw.qweight.min()) >= 0 and int(qw.qweight.max()) <= 15 and bool((qw.zeros == 8).all())
    assert bool((qw.scales < 0).any()) and bool((qw.scales > 0).any())
    if static_groups:  # the groups' grids are fixed up front from the weights: auto-round's
        assert torch.equal(qw.scales.float(), autoround_int_sym(w, 4, 32)[1])
    # GPTQ's result is a better fit of the layer output than rounding to nearest on the same grid
    rtn = autoround_int_sym(w, 4, 32)[0]
    out_err = lambda d: ((d - w) @ x.t()).square().sum()  # noqa: E731
    assert out_err(qw.dequantize()) < out_err(rtn)


def test_unknown_sym_range_is_one_line():
    with pytest.raises(QuantkitError, match="sym_range must be one of centred, exact, full"):
        GPTQQuantizer(sym_range="wide")


@pytest.mark.parametrize("flags, needle", [
    (dict(method="gptq", sym=False), "asymmetric; add --sym"),
    (dict(method="awq"), "asymmetric; add --sym"),          # AWQ's default scheme has a zero point
    (dict(method="rtn", format="gguf"), "no effect on GGUF"),
])
def test_sym_range_where_it_cannot_apply_is_refused(flags, needle):
    """Asked for on an asymmetric scheme or GGUF's fixed grids it would change nothing: one line, not silence."""
    from quantkit.plan import resolve_plan

    with pytest.raises(QuantkitError, match=needle) as e:
        resolve_plan(options={"sym_range": "full"}, **flags)
    assert "\n" not in str(e.value)
    resolve_plan(method="gptq", options={"sym_range": "full"})  # the symmetric default takes it
    # a recipe's own sym_range (gptaq-w4, best-w4: full) is not the user's request: --asym keeps the recipe's
    # other options
    assert resolve_plan(recipe_file="gptaq-w4", sym=False).recipe.quantizer.options["gptaq"] is True
    assert resolve_plan(recipe_file="best-w4", sym=False).recipe.refiners[0].options["iters"] == 100


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors", "awq"])
def test_negative_scales_round_trip_every_layout(fmt):
    qw = rtn_quantize(weights(64, 128, seed=5), 4, 32, True, mse=True, sym_range="full")
    assert bool((qw.scales < 0).any())
    layout = get_format(fmt)
    back = layout.unpack(layout.pack(qw), LinearSpec.of(qw))
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.scales, qw.scales)
    assert torch.equal(back.dequantize(), qw.dequantize())


def test_compressed_tensors_decompressor_reads_negative_scales():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    ct = get_format("compressed-tensors")
    qw = rtn_quantize(weights(64, 128, seed=9), 4, 64, True, mse=True, sym_range="full")
    spec = LinearSpec.of(qw)
    scheme = QuantizationScheme.model_validate(ct.quantization_config({"m": spec}, [], {})["config_groups"]["group_0"])
    out = PackedQuantizationCompressor.decompress(dict(ct.pack(qw)), scheme)
    assert torch.equal(out["weight"], qw.dequantize(torch.float16))


def test_full_range_checkpoint_loads_in_transformers_as_in_quantkit(tmp_path, tiny_llama_dir):
    """A GPTQ run on the full grid written as compressed-tensors: the weights transformers gets from
    compressed-tensors' decompression are exactly quantkit's loader's (computed, as compressed-tensors
    does, in the fp16 of the scales; the centred grid's checkpoints are read the same way)."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    out = tmp_path / "ct-full"
    quantkit.quantize(str(tiny_llama_dir), "gptq", bits=4, group_size=32, format="compressed-tensors", output=out,
                      options={"sym_range": "full"}, num_samples=8, seq_len=64, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(  # decompressed at load: plain Linear weights to compare
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False))
    qk = quantkit.load(str(out), backend="reference", dtype="float32")
    ours = {n: m.quantized_weight() for n, m in qk.named_modules() if isinstance(m, QuantLinear)}
    assert len(ours) == 14 and all(bool((q.scales < 0).any()) for q in ours.values())
    for name, q in ours.items():
        assert torch.equal(hf.get_submodule(name).weight.float(), q.dequantize(torch.float16).float()), name
