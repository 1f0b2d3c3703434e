"""AWQ's scale search before the float presets (#47, `quantizers/awq_float.py`, run by `quantizers/float_passes`).

Oracles outside the code under test: a transformers forward of the untransformed model (the pass is exact in
full precision: clipping is off), compressed-tensors' decompressor and its own NVFP4 rounding of the scaled
weight (`quantize` / `dequantize` with `generate_gparam`), and the written checkpoints' KL to full precision."""
import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.float_checkpoint import DEFAULT_IGNORE, pipeline_linears, read_dequantized, write
from quantkit.plan import resolve_plan
from quantkit.quantizers import float_passes
from quantkit.quantizers.awq_float import FloatAWQ
from quantkit.scheme import LinearScheme
from quantkit.scheme_presets import preset
from test_float_smoothquant import CALIBRATION, HELD_OUT, _kl_of_written, _outlier_llama


def test_the_pass_keeps_the_full_precision_model_and_scales_where_it_helps():
    model, original = _outlier_llama(), _outlier_llama()
    step = float_passes.run_pass(model, preset("NVFP4A16"), float_passes.registered()["awq"],
                                 pipeline_linears(model, DEFAULT_IGNORE)[1], CALIBRATION, {})
    with torch.no_grad():
        torch.testing.assert_close(model(HELD_OUT).logits, original(HELD_OUT).logits, rtol=1e-4, atol=1e-4)
    groups = [g for log in step.search_log.values() for g in log["groups"]]
    assert groups and not any(log["clip"] for log in step.search_log.values())  # clipping is off
    for g in groups:  # the kept candidate has the lowest simulated loss
        assert min(g["losses"]) == g["losses"][round(g["alpha"] * 20) if g["alpha"] is not None else 0]
    # layer 0's norm -> q/k/v group, whose planted channels are what AWQ exists for, is scaled
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, original.model.layers[0].input_layernorm.weight)


def test_the_search_rounds_on_the_format_grid_as_compressed_tensors_does():
    """What a candidate is judged on: the scaled weight rounded to nearest by compressed-tensors' own NVFP4
    (absmax group scales under generate_gparam's global scale), with the range search off to compare."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    step = FloatAWQ(preset("NVFP4A16"))
    ours = step._fake_weight("x", w, LinearScheme(bits=4, group_size=16, sym=True))
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True)
    gparam = generate_gparam(w.min(), w.max())
    groups = w.reshape(32, 4, 16)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=gparam)
    theirs = fake_quantize(w, scale, zero, args, global_scale=gparam)
    searched_away = (ours - theirs).abs().reshape(32, 4, 16).amax(-1) > 0  # groups the range search rescaled
    assert torch.equal(ours.reshape(32, 4, 16)[~searched_away], theirs.reshape(32, 4, 16)[~searched_away])
    assert ((ours - w).square().sum() <= (theirs - w).square().sum())  # the search never rounds worse


@pytest.mark.parametrize("name", ["NVFP4A16", "MXFP4A16"])
def test_awq_checkpoint_decompresses_as_quantkit_loads_it_and_is_closer_to_full_precision(tmp_path, name):
    pytest.importorskip("compressed_tensors")
    write(_outlier_llama(), preset(name), tmp_path / "rtn")
    write(_outlier_llama(), preset(name), tmp_path / "awq", method="awq", calibration=CALIBRATION)
    kl_rtn, kl_awq = _kl_of_written(tmp_path / "rtn"), _kl_of_written(tmp_path / "awq")
    # measured (seed 0): NVFP4A16 0.0016 -> 0.0005, MXFP4A16 0.0020 -> 0.0008
    assert kl_awq < 0.6 * kl_rtn, (kl_awq, kl_rtn)


def test_the_pass_keeps_a_moe_model():
    from test_float_runtime import _tiny_moe

    model, original = _tiny_moe(), _tiny_moe()
    float_passes.run_pass(model, preset("NVFP4A16"), float_passes.registered()["awq"],
                          pipeline_linears(model, DEFAULT_IGNORE)[1], CALIBRATION[:, :20], {})
    with torch.no_grad():
        torch.testing.assert_close(model(HELD_OUT).logits, original(HELD_OUT).logits, rtol=1e-4, atol=1e-4)


def test_refusals_name_the_problem_and_the_fix(tmp_path):
    with pytest.raises(QuantkitError, match="drop clip .the format's range search, mse, plays clipping's part"):
        resolve_plan("awq", scheme="NVFP4A16", options={"clip": True, "n_grid": 10})
    with pytest.raises(QuantkitError, match="with round-to-nearest takes no method options; drop mse"):
        resolve_plan("awq", scheme="NVFP4A16", options={"mse": False})  # a default-valued option is not dropped
    with pytest.raises(QuantkitError, match="awq before --scheme MXFP4A16 measures activations: it needs calibration"):
        write(_outlier_llama(), preset("MXFP4A16"), tmp_path / "x", method="awq")
    assert not (tmp_path / "x").exists()
    plan = resolve_plan("awq,gptq", scheme="nvfp4a16", options={"n_grid": 10, "damp_percent": 0.02})
    assert plan.recipe.name == "awq+gptq" and plan.calibration is not None


def test_w4afp8_takes_the_integer_awq_exactly_as_the_integer_path_runs_it(tmp_path):
    """W4AFP8's weights are int4 groups of 128: `--method awq` before it is the integer AWQ transform (with its
    clipping) finished by round-to-nearest, so the written weights (as compressed-tensors decompresses them,
    checked by _kl_of_written) are exactly the integer pipeline's `awq` on that scheme, norms included; and
    the checkpoint is closer to full precision than W4AFP8's round-to-nearest."""
    pytest.importorskip("compressed_tensors")
    from quantkit.models import get_adapter
    from quantkit.pipeline import quantize_model
    from quantkit.quantizers.recipe import build_recipe

    write(_outlier_llama(), preset("W4AFP8"), tmp_path / "rtn")
    model = _outlier_llama()
    write(model, preset("W4AFP8"), tmp_path / "awq", method="awq", calibration=CALIBRATION)
    awq = read_dequantized(tmp_path / "awq")
    plan = resolve_plan("awq", scheme="W4AFP8", options={"n_grid": 20})
    assert plan.recipe.name == "awq" and plan.calibration is not None
    integer = _outlier_llama()
    names = pipeline_linears(integer, DEFAULT_IGNORE)[1]
    results = quantize_model(integer, get_adapter(integer), build_recipe("awq", {}),
                             dict.fromkeys(names, LinearScheme(bits=4, group_size=128, sym=True)), CALIBRATION,
                             batch_size=8, progress=False)
    assert sorted(awq) == sorted(names)
    for name in names:
        assert torch.equal(awq[name], results[name].dequantize()), name
    for a, b in zip(model.model.layers, integer.model.layers):
        assert torch.equal(a.input_layernorm.weight, b.input_layernorm.weight)
    kl_rtn, kl_awq = _kl_of_written(tmp_path / "rtn"), _kl_of_written(tmp_path / "awq")
    assert kl_awq < 0.6 * kl_rtn, (kl_awq, kl_rtn)  # measured (seed 0): 0.0018 -> 0.0008
