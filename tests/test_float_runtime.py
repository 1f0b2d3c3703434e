"""quantkit.load runs the compressed-tensors float checkpoints (#47: FP8 / NVFP4 / MXFP4 / W4AFP8) on the CPU.

Oracles, none of them quantkit code:
- the weights: compressed-tensors' own per-module decompressors (`BaseCompressor` registry, the classes
  transformers calls), put into a plain transformers model (dense linears, or the fused expert parameters);
- the input activations: compressed-tensors' `compute_dynamic_scales_and_zp` + `fake_quantize`, as forward
  pre-hooks on that plain model's linears (what compressed-tensors' own forward does), under the checkpoint's
  stored input_scale / input_global_scale where the preset's activations are static (FP8, NVFP4).
compressed-tensors decompresses NVFP4 into bfloat16 and int4 (W4AFP8) into the scales' float16, which round
the products; the oracle calls the same decompressor's two steps (`unpack_fp4_from_uint8` / `unpack_from_int32`,
`dequantize`) in float32 and checks that their rounding is exactly the decompressor's output.
"""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

import quantkit
from quantkit.errors import QuantkitError
from quantkit.float_checkpoint import WRITABLE, write
from quantkit.runtime.float_linear import FloatLinear
from quantkit.scheme_presets import preset
from tiny_models import tiny_model

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize, fake_quantize  # noqa: E402
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp  # noqa: E402

TOKENS = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(1))
CALIBRATION = torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(2))


def ct_decompressed(folder) -> dict[str, torch.Tensor]:
    """{checkpoint module name: float32 weight} by compressed-tensors' decompressor for the folder's format."""
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    (group,) = qcfg["config_groups"].values()
    scheme = QuantizationScheme(targets=group["targets"], weights=QuantizationArgs(**group["weights"]))
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    state = load_file(str(folder / "model.safetensors"))
    names = sorted(k[: -len(".weight_scale")] for k in state if k.endswith(".weight_scale"))
    out = {}
    for name in names:
        local = {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".") and
                 "." not in k[len(name) + 1:]}
        theirs = compressor.decompress(local, scheme)["weight"]
        if group["format"] == "nvfp4-pack-quantized":
            packed = local["weight_packed"]
            exact = dequantize(x_q=unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32),
                               scale=local["weight_scale"].to(torch.float32), args=scheme.weights,
                               global_scale=local["weight_global_scale"], dtype=torch.float32)
            assert torch.equal(exact.to(theirs.dtype), theirs), name
            out[name] = exact
        elif group["format"] == "pack-quantized":
            codes = unpack_from_int32(local["weight_packed"], scheme.weights.num_bits, local["weight_shape"])
            exact = dequantize(x_q=codes, scale=local["weight_scale"].to(torch.float32), args=scheme.weights,
                               dtype=torch.float32)
            assert torch.equal(exact.to(theirs.dtype), theirs), name
            out[name] = exact
        else:
            out[name] = theirs.to(torch.float32)
    return out


def with_ct_activations(model: torch.nn.Module, name: str, folder=None) -> torch.nn.Module:
    """`model`'s linears (lm_head excepted) fake-quantize their input as compressed-tensors does for preset `name`
    (`forward_quantize`: static activations use the input_scale / input_global_scale stored in `folder`)."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    args = PRESET_SCHEMES[name].get("input_activations")
    if args is None:
        return model
    args = args if isinstance(args, QuantizationArgs) else QuantizationArgs(**args)
    state = load_file(str(folder / "model.safetensors")) if folder is not None else {}

    def hook_for(module_name):
        global_scale = state.get(f"{module_name}.input_global_scale")
        static_scale = state.get(f"{module_name}.input_scale")

        def hook(module, inputs):
            if static_scale is not None:
                return (fake_quantize(inputs[0], static_scale, None, args),)
            scale, zero_point = compute_dynamic_scales_and_zp(inputs[0], args, module, global_scale=global_scale)
            return (fake_quantize(inputs[0], scale, zero_point, args, global_scale=global_scale),)
        return hook

    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module_name != "lm_head":
            if args.dynamic is not True:
                assert (module_name + (".input_scale" if name == "FP8" else ".input_global_scale")) in state
            module.register_forward_pre_hook(hook_for(module_name))
    return model


def logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("name", WRITABLE)
def test_load_runs_each_preset_as_compressed_tensors_defines_it(tmp_path, name):
    """Weights and activations both: quantkit.load's logits equal a plain transformers forward on the weights
    compressed-tensors decompresses, its inputs fake-quantized by compressed-tensors (fp32 tolerance)."""
    source = tiny_model("llama", hidden_size=128, intermediate_size=256)  # FP8_BLOCK's activations: groups of 128
    static = preset(name).calibrates_activations  # FP8, NVFP4: input scales measured on calibration tokens
    write(source, preset(name), tmp_path / name, calibration=CALIBRATION if static else None)
    oracle = tiny_model("llama", hidden_size=128, intermediate_size=256)
    weights = ct_decompressed(tmp_path / name)
    assert len(weights) == 14  # every linear but lm_head
    with torch.no_grad():
        for module_name, w in weights.items():
            assert not torch.equal(oracle.get_submodule(module_name).weight, w)
            oracle.get_submodule(module_name).weight.copy_(w)
    ours = quantkit.load(tmp_path / name, dtype="float32")
    layers = {n: m for n, m in ours.named_modules() if isinstance(m, FloatLinear)}
    assert sorted(layers) == sorted(weights)
    for module_name, layer in layers.items():
        assert torch.equal(layer.dequantized_weight(), weights[module_name]), module_name
    want = logits(with_ct_activations(oracle, name, tmp_path / name))
    got = logits(ours)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if preset(name).input_activations is not None:  # the activations really are quantized
        assert (got - logits(_weight_only(ours))).abs().max() > 1e-3


def _weight_only(model):
    for m in model.modules():
        if isinstance(m, FloatLinear):
            m.input_activations = None
    return model


def test_float8_buffers_survive_dtype_casts_and_damage_is_refused(tmp_path):
    write(tiny_model("llama"), preset("FP8_DYNAMIC"), tmp_path / "fp8")
    model = quantkit.load(tmp_path / "fp8", dtype="float32")
    layer = model.model.layers[0].mlp.down_proj
    before = layer.dequantized_weight()
    model.to(torch.bfloat16)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    assert torch.equal(layer.dequantized_weight(), before)
    assert logits(model).dtype == torch.bfloat16

    # a scale of the wrong dtype, a missing tensor, a NaN scale: one line each, naming the tensor
    state = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight_scale"
    cases = {"dtype": {**state, key: state[key].double()},
             "missing": {k: v for k, v in state.items() if k != key},
             "nan": {**state, key: torch.full_like(state[key], float("nan"))}}
    from safetensors.torch import save_file
    for case, tensors in cases.items():
        (tmp_path / case).mkdir()
        (tmp_path / case / "config.json").write_text((tmp_path / "fp8" / "config.json").read_text())
        save_file(tensors, str(tmp_path / case / "model.safetensors"))
        with pytest.raises(QuantkitError, match="mlp.down_proj.weight_scale") as err:
            quantkit.load(tmp_path / case)
        assert "\n" not in str(err.value)


def test_unsupported_activation_scheme_is_refused(tmp_path):
    write(tiny_model("llama"), preset("FP8_DYNAMIC"), tmp_path / "fp8")
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"]["num_bits"] = 4
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantkitError, match="input activations quantized as float 4-bit token"):
        quantkit.load(tmp_path / "fp8")


MOE = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=128, num_experts_per_tok=2, moe_intermediate_size=128, num_experts=4,
           norm_topk_prob=True, head_dim=32)


def _tiny_moe():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**MOE), dtype=torch.float32,
                                                          experts_implementation="eager").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)  # decisive routing: no near-ties for rounding to flip
    return model


@pytest.mark.parametrize("name", ["NVFP4A16", "FP8_BLOCK"])
def test_moe_experts_written_per_expert_and_loaded(tmp_path, name):
    """A tiny Qwen3-MoE: every expert's projections are written (routers kept in full precision), gate and up
    share one NVFP4 global scale (one fused weight in vLLM), compressed-tensors' decompressor reads every
    expert, and quantkit.load computes what transformers' fused experts compute on those weights."""
    source = _tiny_moe()
    write(source, preset(name), tmp_path / name)
    qcfg = json.loads((tmp_path / name / "config.json").read_text())["quantization_config"]
    assert qcfg["ignore"] == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    weights = ct_decompressed(tmp_path / name)
    assert len(weights) == 2 * (4 + 4 * 3)  # per layer: q/k/v/o and 4 experts x gate/up/down
    state = load_file(str(tmp_path / name / "model.safetensors"))
    if name == "NVFP4A16":
        for e in range(4):
            prefix = f"model.layers.1.mlp.experts.{e}"
            assert torch.equal(state[f"{prefix}.gate_proj.weight_global_scale"],
                               state[f"{prefix}.up_proj.weight_global_scale"])
        assert torch.equal(state["model.layers.0.self_attn.q_proj.weight_global_scale"],
                           state["model.layers.0.self_attn.v_proj.weight_global_scale"])
    oracle = _tiny_moe()
    with torch.no_grad():
        for layer_index, layer in enumerate(oracle.model.layers):
            prefix = f"model.layers.{layer_index}"
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, proj).weight.copy_(weights[f"{prefix}.self_attn.{proj}"])
            experts = layer.mlp.experts
            i = experts.gate_up_proj.shape[1] // 2
            for e in range(4):
                experts.gate_up_proj[e, :i] = weights[f"{prefix}.mlp.experts.{e}.gate_proj"]
                experts.gate_up_proj[e, i:] = weights[f"{prefix}.mlp.experts.{e}.up_proj"]
                experts.down_proj[e] = weights[f"{prefix}.mlp.experts.{e}.down_proj"]
    ours = _weight_only(quantkit.load(tmp_path / name, dtype="float32"))  # the fused experts take no input hooks
    torch.testing.assert_close(logits(ours), logits(oracle), rtol=1e-5, atol=1e-5)
    if name == "FP8_BLOCK":  # transformers' own MoE loading decompresses the same fused weights
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / name, dtype=torch.float32,
            quantization_config=transformers.CompressedTensorsConfig(run_compressed=False))
        assert torch.equal(hf.model.layers[1].mlp.experts.gate_up_proj, oracle.model.layers[1].mlp.experts.gate_up_proj)


def test_a_malformed_config_is_not_taken_for_a_float_one():
    """The loader asks is_float_config first; a damaged config must reach the integer reader's one-line
    refusal instead of crashing here (found by test_robustness's checkpoint fuzzer)."""
    from quantkit.formats.ct_float_layouts import is_float_config

    for qcfg in ({"config_groups": "x"}, {"config_groups": ["x"]}, None, "x", {"config_groups": {"g": "x"}}):
        assert is_float_config(qcfg) is False
    assert is_float_config({"config_groups": {"g": {"format": "nvfp4-pack-quantized"}}}) is True
