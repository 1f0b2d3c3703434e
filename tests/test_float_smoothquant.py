"""SmoothQuant before the float presets that quantize activations (#47, `quantizers/smoothquant_float.py`).

Oracles outside the code under test: a transformers forward of the unsmoothed model (the pass is exact in full
precision), plain-PyTorch arithmetic for SmoothQuant's scales, compressed-tensors' decompressor for the written
weights, and a plain-PyTorch forward (dequantized weights, inputs rounded by torch's float8 cast) for W4AFP8."""
import copy
import json

import pytest
import torch
import transformers

import quantkit
from quantkit.errors import QuantkitError
from quantkit.float_checkpoint import write
from quantkit.plan import resolve_plan
from quantkit.quantizers.smoothquant_float import smooth
from quantkit.scheme_presets import preset

CALIBRATION = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
HELD_OUT = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))
LINEARS = [f"model.layers.{i}.{p}" for i in range(2) for p in
           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def _outlier_llama():
    """A tiny Llama whose norms put four channels 30x above the rest, undone in the linears after them (the
    function is unchanged; the activation outliers are the kind SmoothQuant exists for)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=128, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            for norm, linears in ((layer.input_layernorm, (a.q_proj, a.k_proj, a.v_proj)),
                                  (layer.post_attention_layernorm, (m.gate_proj, m.up_proj))):
                norm.weight[:4] *= 30
                for lin in linears:
                    lin.weight[:, :4] /= 30
    return model


def _kl(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return float(torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                            reduction="none").sum(-1).mean())


def _kl_of_written(folder) -> float:
    """`folder`'s KL to the unquantized outlier Llama on HELD_OUT, once compressed-tensors' decompressor and
    quantkit.load are checked to read exactly the weights quantkit's reader reads (`read_dequantized`)."""
    from quantkit.float_checkpoint import read_dequantized
    from test_float_runtime import ct_decompressed

    written = read_dequantized(folder)
    decompressed, loaded = ct_decompressed(folder), quantkit.load(folder)
    assert written
    for module_name, w in written.items():
        assert torch.equal(decompressed[module_name], w)
        assert torch.equal(loaded.get_submodule(module_name).dequantized_weight(), w)
    with torch.no_grad():
        return _kl(loaded(HELD_OUT).logits, _outlier_llama()(HELD_OUT).logits)


def test_the_pass_keeps_the_full_precision_model_and_folds_smoothquants_scales():
    model = _outlier_llama()
    original = copy.deepcopy(model)
    with torch.no_grad():
        reference = original(HELD_OUT).logits
        # SmoothQuant's scales by hand for layer 0's q/k/v: s = max|x|^0.5 / max|W|^0.5 over the calibration set
        seen = []
        h = original.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        original(CALIBRATION)
        h.remove()
    x_max = torch.cat([x.reshape(-1, 128) for x in seen]).abs().amax(0)
    a = original.model.layers[0].self_attn
    w_max = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).abs().amax(0)
    s = x_max.sqrt() / w_max.sqrt()

    log = smooth(model, preset("NVFP4"), LINEARS, CALIBRATION, {"alpha": 0.5})
    assert [e["alpha"] for e in log[0]] == [0.5, 0.5]  # norm -> q/k/v and norm -> gate/up; no linear -> linear
    torch.testing.assert_close(model.model.layers[0].input_layernorm.weight,
                               original.model.layers[0].input_layernorm.weight / s, rtol=1e-5, atol=0)
    torch.testing.assert_close(model.model.layers[0].self_attn.k_proj.weight, a.k_proj.weight * s, rtol=1e-5, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(HELD_OUT).logits, reference, rtol=1e-4, atol=1e-4)


def test_auto_search_tries_no_smoothing_first_and_keeps_the_lowest_loss():
    model = _outlier_llama()
    log = smooth(model, preset("W4AFP8"), LINEARS, CALIBRATION, {"alpha": "auto", "alpha_step": 0.25})
    for entries in log.values():
        for e in entries:
            assert list(e["losses"]) == [None, 0.0, 0.25, 0.5, 0.75, 1.0]
            best, tried = min(e["losses"].values()), list(e["losses"])
            assert e["losses"][e["alpha"]] == best
            assert all(e["losses"][a] > best for a in tried[:tried.index(e["alpha"])])  # a tie keeps the first
            if e["alpha"] is None:
                assert torch.equal(e["scales"], torch.ones_like(e["scales"]))
    # with those outliers, smoothing wins somewhere: the planted channels are what it exists for
    assert any(e["alpha"] is not None for entries in log.values() for e in entries)


@pytest.mark.parametrize("name", ["NVFP4", "W4AFP8"])
def test_smoothed_checkpoint_decompresses_as_quantkit_loads_it_and_is_closer_to_full_precision(tmp_path, name):
    pytest.importorskip("compressed_tensors")
    needs_ids = preset(name).calibrates_activations
    write(_outlier_llama(), preset(name), tmp_path / "plain", method="rtn",
                  calibration=CALIBRATION if needs_ids else None)
    write(_outlier_llama(), preset(name), tmp_path / "smooth", method="smoothquant",
                     calibration=CALIBRATION, options={"alpha": "auto"})
    kl_plain, kl_smooth = _kl_of_written(tmp_path / "plain"), _kl_of_written(tmp_path / "smooth")
    # measured (seed 0): NVFP4 0.0036 -> 0.0010, W4AFP8 0.0018 -> 0.0007
    assert kl_smooth < 0.6 * kl_plain, (kl_smooth, kl_plain)


def test_w4afp8_smoothed_forward_equals_plain_pytorch_on_the_written_tensors(tmp_path):
    """The loader runs the smoothed checkpoint as its files say: the norms' new weights from the file, int4
    weights dequantized from compressed-tensors' decompressor, inputs rounded per token by torch's E4M3 cast."""
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import load_file
    from test_float_runtime import ct_decompressed

    write(_outlier_llama(), preset("W4AFP8"), tmp_path / "w", method="smoothquant", calibration=CALIBRATION,
          options={"alpha": 0.5})
    state = load_file(str(tmp_path / "w" / "model.safetensors"))
    weights = ct_decompressed(tmp_path / "w")
    model = _outlier_llama()
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()}, strict=False)

    def fp8_per_token(module, args):
        x = args[0]
        scale = x.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 448
        return ((x / scale).to(torch.float8_e4m3fn).float() * scale,)

    with torch.no_grad():
        for name, w in weights.items():
            lin = model.get_submodule(name)
            lin.weight.copy_(w)
            lin.register_forward_pre_hook(fp8_per_token)
        assert not torch.equal(model.model.layers[0].input_layernorm.weight,
                               _outlier_llama().model.layers[0].input_layernorm.weight)  # the fold was written
        torch.testing.assert_close(quantkit.load(tmp_path / "w")(HELD_OUT).logits, model(HELD_OUT).logits,
                                   rtol=1e-4, atol=1e-4)


def test_refusals_name_the_problem_and_the_fix(tmp_path):
    with pytest.raises(QuantkitError, match="NVFP4A16 quantizes weights only.*drop smoothquant"):
        resolve_plan("smoothquant,gptq", scheme="NVFP4A16")
    with pytest.raises(QuantkitError, match="sets its own input activations; drop the activations option"):
        resolve_plan("smoothquant", scheme="FP8_DYNAMIC", options={"activations": "static"})
    with pytest.raises(QuantkitError, match="alpha must be a number in"):
        resolve_plan("smoothquant", scheme="NVFP4", options={"alpha": 1.5})
    with pytest.raises(QuantkitError, match="needs calibration"):
        write(_outlier_llama(), preset("W4AFP8"), tmp_path / "x", method="smoothquant")
    assert not (tmp_path / "x").exists()
    plan = resolve_plan("smoothquant,gptq", scheme="w4afp8", options={"alpha": "auto", "damp_percent": 0.02})
    assert plan.recipe.name == "smoothquant+gptq" and plan.calibration is not None  # RTN alone reads none
    assert resolve_plan("rtn", scheme="W4AFP8").calibration is None


def test_cli_writes_a_smoothed_nvfp4_checkpoint_with_its_method_on_the_card(tmp_path, tiny_llama_dir):
    from conftest import run_cli

    out = tmp_path / "sq"
    r = run_cli("quantize", "--model", tiny_llama_dir, "--scheme", "nvfp4", "--method", "smoothquant,gptq",
                "--option", "alpha=auto", "--num-samples", "4", "--seq-len", "32", "--output", out)
    assert r.returncode == 0, r.stderr
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "nvfp4-pack-quantized"
    card = (out / "README.md").read_text()
    assert "method: `smoothquant+gptq`" in card and "alpha: `auto`" in card


def test_the_pass_keeps_a_moe_model_and_every_expert_it_seldom_routes_to(tmp_path):
    """A tiny Qwen3-MoE (fused experts): the norm -> experts' gate/up group is smoothed with the router as a
    follower, and experts too few calibration tokens reached are kept as they are, not rounded (the pipeline's
    fallback for them would round them to its scheme)."""
    from test_float_runtime import _tiny_moe

    from quantkit.float_checkpoint import DEFAULT_IGNORE, pipeline_linears

    model, original = _tiny_moe(), _tiny_moe()
    log = smooth(model, preset("NVFP4"), pipeline_linears(model, DEFAULT_IGNORE)[1], CALIBRATION[:, :20],
                 {"alpha": 0.5})
    assert all(len(entries) == 2 for entries in log.values())  # norm -> q/k/v and norm -> every expert's gate/up
    with torch.no_grad():
        torch.testing.assert_close(model(HELD_OUT).logits, original(HELD_OUT).logits, rtol=1e-4, atol=1e-4)
    unchanged = _tiny_moe()
    smooth(unchanged, preset("NVFP4"), pipeline_linears(unchanged, DEFAULT_IGNORE)[1], CALIBRATION[:, :20],
           {"smooth": False})
    assert all(torch.equal(a, b) for a, b in zip(unchanged.state_dict().values(), original.state_dict().values()))


def test_fp4_activation_presets_smooth_by_default_and_an_explicit_method_stays_plain():
    from quantkit.run_recipe import non_default_options

    for name in ("NVFP4", "mxfp4"):
        plan = resolve_plan(None, scheme=name)
        assert plan.recipe.name == "smoothquant" and non_default_options(plan.recipe) == {"alpha": "auto"}
        assert plan.calibration is not None
        assert non_default_options(resolve_plan(None, scheme=name, options={"alpha": 0.7}).recipe) == {"alpha": 0.7}
        assert resolve_plan("rtn", scheme=name).recipe.name == "rtn"
        assert resolve_plan("gptq", scheme=name).recipe.name == "gptq"
    for name in ("NVFP4A16", "MXFP4A16", "FP8", "FP8_DYNAMIC", "W4AFP8"):  # no FP4 activations: round to nearest
        assert resolve_plan(None, scheme=name).recipe.name == "rtn"
