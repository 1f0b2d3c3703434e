"""FP8 / NVFP4's calibrated input scales and W4AFP8's int4 weights under FP8 activations (#47), checked against
oracles that are not quantkit code: plain-PyTorch hooks and arithmetic for the scales, compressed-tensors'
`generate_gparam` and `QuantizationConfig` / preset table for the NVFP4 global scale and the config, and a
plain-PyTorch unpacking of pack-quantized's int32 words for W4AFP8."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

import quantkit
from quantkit.errors import QuantkitError
from quantkit.float_checkpoint import write
from quantkit.plan import resolve_plan
from quantkit.scheme_presets import preset

pytest.importorskip("compressed_tensors")

CALIBRATION = torch.randint(0, 256, (6, 20), generator=torch.Generator().manual_seed(3))


def _tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=128, tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _hooked_inputs(model, ids) -> dict[str, torch.Tensor]:
    """{linear name: every input it saw, concatenated} from a plain forward with pre-hooks (lm_head excepted)."""
    seen, handles = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            handles.append(module.register_forward_pre_hook(
                lambda m, args, name=name: seen.setdefault(name, []).append(args[0].detach().reshape(-1).clone())))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


def test_fp8_input_scale_is_the_calibration_absmax_over_448(tmp_path):
    inputs = _hooked_inputs(_tiny_llama(), CALIBRATION)
    write(_tiny_llama(), preset("FP8"), tmp_path / "fp8", method="rtn", calibration=CALIBRATION, batch_size=8)
    state = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    assert len(inputs) == 14
    for name, x in inputs.items():
        stored = state[f"{name}.input_scale"]
        assert stored.dtype == torch.float32 and stored.shape == (1,)
        # round-to-nearest: measured on the model as given, every calibration token
        torch.testing.assert_close(stored, (x.abs().max() / 448.0).reshape(1), rtol=0, atol=0)


@pytest.mark.parametrize("stored", [False, True])
@pytest.mark.parametrize("name,suffix", [("FP8", "input_scale"), ("NVFP4", "input_global_scale")])
def test_gptqs_input_scales_are_those_of_the_quantized_models_own_inputs(tmp_path, name, suffix, stored):
    """With GPTQ the static input scales come from the inputs its pipeline observed: each linear's input with
    every linear before it (earlier layers, and earlier stages of its own layer) already quantized, which is the
    input the written checkpoint's linear sees (llm-compressor's sequential pipeline observes the same). The
    oracle: plain hooks on a forward of the model GPTQ leaves fake-quantized (its weights are the checkpoint's).
    `stored`: the results pass through a progress store (as `quantize` runs it, for --resume) on the way."""
    from compressed_tensors.quantization.utils import generate_gparam

    from quantkit.progress import ProgressStore

    model = _tiny_llama()
    original = _hooked_inputs(_tiny_llama(), CALIBRATION)
    store = None
    if stored:
        store = ProgressStore(tmp_path / "staging")
        store.start({"run": "test"}, resume=False)
    write(model, preset(name), tmp_path / "q", method="gptq", calibration=CALIBRATION, batch_size=8, store=store)
    assert not stored or len(store.done_layers()) == 2
    quantized = _hooked_inputs(model, CALIBRATION)  # every linear of `model` now holds its checkpoint weight
    state = load_file(str(tmp_path / "q" / "model.safetensors"))
    assert len(quantized) == 14
    moved = 0
    for layer in ("model.layers.0", "model.layers.1"):
        groups = ([f"{layer}.self_attn.{p}_proj" for p in "qkv"], [f"{layer}.self_attn.o_proj"],
                  [f"{layer}.mlp.gate_proj", f"{layer}.mlp.up_proj"], [f"{layer}.mlp.down_proj"])
        for group in groups:
            x = torch.cat([quantized[n] for n in group])  # NVFP4's fused siblings share one; their inputs are one
            want = ((x.abs().max() / 448.0).reshape(1) if name == "FP8"
                    else generate_gparam(x.min().reshape(1), x.max().reshape(1)))
            for n in group:
                torch.testing.assert_close(state[f"{n}.{suffix}"], want, rtol=1e-6, atol=0)
                moved += not torch.equal(quantized[n].abs().max(), original[n].abs().max())
    assert moved >= 6  # the quantized model's inputs are not the original's: later linears' scales moved


def test_nvfp4_input_global_scale_is_compressed_tensors_generate_gparam(tmp_path):
    from compressed_tensors.quantization.utils import generate_gparam

    inputs = _hooked_inputs(_tiny_llama(), CALIBRATION)
    write(_tiny_llama(), preset("NVFP4"), tmp_path / "nvfp4", calibration=CALIBRATION, batch_size=8)
    state = load_file(str(tmp_path / "nvfp4" / "model.safetensors"))
    for name, x in inputs.items():
        want = generate_gparam(x.min().reshape(1), x.max().reshape(1))  # compressed-tensors' own definition
        assert torch.equal(state[f"{name}.input_global_scale"], want), name
    for layer in ("model.layers.0", "model.layers.1"):  # siblings vLLM fuses share one (they read the same input)
        q, k, v = (state[f"{layer}.self_attn.{p}_proj.input_global_scale"] for p in "qkv")
        assert torch.equal(q, k) and torch.equal(q, v)
        assert torch.equal(state[f"{layer}.mlp.gate_proj.input_global_scale"],
                           state[f"{layer}.mlp.up_proj.input_global_scale"])


@pytest.mark.parametrize("name", ["FP8", "NVFP4", "W4AFP8", "MXFP4XFP8", "MXFP8A16", "MXFP8"])
def test_config_validates_as_compressed_tensors_preset(tmp_path, name):
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    write(_tiny_llama(), preset(name), tmp_path / name,
          calibration=CALIBRATION if preset(name).calibrates_activations else None)
    qcfg = json.loads((tmp_path / name / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qcfg)
    (group,) = parsed.config_groups.values()
    theirs = preset_name_to_scheme(name, ["Linear"])
    for role in ("weights", "input_activations"):
        got, want = getattr(group, role), getattr(theirs, role)
        if want is None:
            assert got is None, role
            continue
        for field in ("type", "num_bits", "strategy", "group_size", "dynamic", "symmetric", "scale_dtype"):
            assert getattr(got, field) == getattr(want, field), (role, field)
    assert parsed.format == {"FP8": "float-quantized", "NVFP4": "nvfp4-pack-quantized", "W4AFP8": "pack-quantized",
                             "MXFP4XFP8": "mxfp4-pack-quantized", "MXFP8A16": "mxfp8-quantized",
                             "MXFP8": "mxfp8-quantized"}[name]


def _unpack_int4_words(words: torch.Tensor, k: int) -> torch.Tensor:
    """Plain PyTorch: eight 4-bit codes per int32, least significant first along the row."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(8, dtype=torch.int64) * 4
    return ((w.unsqueeze(-1) >> shifts) & 0xF).reshape(words.shape[0], -1)[:, :k]


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_w4afp8_weights_unpack_by_plain_pytorch(tmp_path, method):
    model = _tiny_llama()
    from quantkit.float_checkpoint import read_dequantized

    shapes = write(model, preset("W4AFP8"), tmp_path / "w4", method=method,
                   calibration=CALIBRATION if method == "gptq" else None)
    ours = read_dequantized(tmp_path / "w4")  # checked against plain PyTorch's unpacking below
    assert sorted(ours) == sorted(shapes)
    state = load_file(str(tmp_path / "w4" / "model.safetensors"))
    assert not any(k.endswith(("input_scale", "weight_zero_point")) for k in state)  # dynamic inputs, symmetric
    for name, w in ours.items():
        n, k = state[f"{name}.weight_shape"].tolist()
        codes = _unpack_int4_words(state[f"{name}.weight_packed"], k)
        scale = state[f"{name}.weight_scale"]
        assert scale.shape == (n, k // 128)
        want = (codes.float() - 8) * scale.float().repeat_interleave(128, dim=1)
        assert torch.equal(want, w), name
    loaded = quantkit.load(tmp_path / "w4", dtype="float32")
    layer = loaded.model.layers[0].mlp.down_proj
    assert torch.equal(layer.dequantized_weight(), ours["model.layers.0.mlp.down_proj"])
    x = torch.randn(3, 256) * 2  # activations: per-token FP8 (absmax / 448 per row), in plain PyTorch
    s = x.abs().amax(dim=-1, keepdim=True) / 448.0
    want = torch.nn.functional.linear((x / s).to(torch.float8_e4m3fn).float() * s, ours["model.layers.0.mlp.down_proj"])
    torch.testing.assert_close(layer(x), want, rtol=1e-6, atol=1e-6)


def test_fp8_static_inputs_clamp_at_the_calibrated_range(tmp_path):
    write(_tiny_llama(), preset("FP8"), tmp_path / "fp8", calibration=CALIBRATION)
    layer = quantkit.load(tmp_path / "fp8", dtype="float32").model.layers[0].mlp.down_proj
    s = layer.input_scale
    x = torch.randn(2, 256) * 0.1
    x[0, 0] = 1000 * float(s)  # past +448 * input_scale: saturates, as E4M3 "fn" has no infinity
    q = ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(q, layer.dequantized_weight()), rtol=1e-6, atol=1e-6)


def test_plan_gathers_calibration_for_static_activations_and_refuses_other_methods():
    assert resolve_plan("rtn", scheme="FP8").calibration is not None  # the int path's calibration settings
    assert resolve_plan("rtn", scheme="nvfp4", calibration={"num_samples": 8}).calibration.num_samples == 8
    assert resolve_plan("rtn", scheme="W4AFP8").calibration is None  # dynamic activations: RTN reads no data
    assert resolve_plan("gptq", scheme="W4AFP8", options={"damp_percent": 0.05}).float_preset.name == "W4AFP8"
    with pytest.raises(QuantkitError, match="--scheme NVFP4 is written by --method rtn, gptq, gptq\\+signround, "
                                            "smoothquant, smoothquant\\+gptq, smoothquant\\+gptq\\+signround, awq, "
                                            "awq\\+gptq, awq\\+gptq\\+signround; drop --method rtn\\+signround"):
        resolve_plan("rtn,signround", scheme="NVFP4")
    assert resolve_plan("smoothquant", scheme="NVFP4").recipe.name == "smoothquant"  # tests/test_float_smoothquant.py
    with pytest.raises(QuantkitError, match="reads no calibration data, so --num-samples would be ignored"):
        resolve_plan("rtn", scheme="W4AFP8", calibration={"num_samples": 8})


def test_api_writes_fp8_with_rtn_from_its_own_calibration(tmp_path, tiny_llama_dir):
    out = tmp_path / "fp8"
    result = quantkit.quantize(str(tiny_llama_dir), "rtn", scheme="FP8", output=out, num_samples=4, seq_len=32,
                               progress=False)
    assert result.summary["layout"] == "float-quantized"
    state = load_file(str(out / "model.safetensors"))
    assert len([k for k in state if k.endswith(".input_scale")]) == 14
    recipe = (out / "recipe.yaml").read_text()
    assert "num_samples: 4" in recipe and "scheme: FP8" in recipe
    quantkit.quantize(recipe=str(out / "recipe.yaml"), output=tmp_path / "replay", progress=False)
    assert (tmp_path / "replay" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    with pytest.raises(QuantkitError, match="group_size 128 must divide in_features 64"):
        quantkit.quantize(str(tiny_llama_dir), "rtn", scheme="W4AFP8", output=tmp_path / "w4", progress=False)
    assert not (tmp_path / "w4").exists()


def test_load_reads_w4afp8_as_compressed_tensors_itself_writes_it(tmp_path):
    """compressed-tensors (and llm-compressor on top of it) compress W4AFP8 int-quantized: int8 codes, scales in
    the model's dtype (bfloat16 here). quantkit.load must read exactly the weights its decompressor gives."""
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    from quantkit.runtime.float_linear import FloatLinear

    model = _tiny_llama().to(torch.bfloat16)
    scheme = preset_name_to_scheme("W4AFP8", ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                g = module.weight.reshape(module.weight.shape[0], -1, 128)
                scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    out = tmp_path / "ct-w4afp8"
    model.save_pretrained(out)
    compressor.update_config(out)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "int-quantized"
    state = load_file(str(out / "model.safetensors"))
    decompressor = BaseCompressor.get_value_from_registry("int-quantized")
    loaded = quantkit.load(out, dtype="float32")
    layers = {n: m for n, m in loaded.named_modules() if isinstance(m, FloatLinear)}
    assert len(layers) == 14
    for name, layer in layers.items():
        local = {k: state[f"{name}.{k}"] for k in ("weight", "weight_scale")}
        assert local["weight_scale"].dtype == torch.bfloat16
        theirs = decompressor.decompress(local, scheme)["weight"]
        exact = dequantize(x_q=local["weight"], scale=local["weight_scale"].float(), args=scheme.weights,
                           dtype=torch.float32)
        assert torch.equal(exact.to(theirs.dtype), theirs), name
        assert torch.equal(layer.dequantized_weight(), exact), name
    assert torch.isfinite(loaded(CALIBRATION[:1]).logits).all()
    bad = {**state, "model.layers.0.mlp.down_proj.weight": torch.full_like(state["model.layers.0.mlp.down_proj.weight"], 9)}
    from safetensors.torch import save_file

    save_file(bad, str(out / "model.safetensors"))
    with pytest.raises(QuantkitError, match="holds codes outside 4-bit"):
        quantkit.load(out)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_moe_experts_get_their_own_input_scales(tmp_path, method):
    """A tiny Qwen3-MoE in NVFP4: every expert projection is hooked on the tokens routed to it and stores its
    input_global_scale (gate/up one, as vLLM fuses them); the routers stay in full precision with none; the
    q/k/v scales equal generate_gparam of the attention input a plain hook sees (of the model as given with
    round-to-nearest; of the model GPTQ leaves quantized with GPTQ, whose pipeline observed them)."""
    from compressed_tensors.quantization.utils import generate_gparam
    from test_float_runtime import _tiny_moe

    model = _tiny_moe()
    write(model, preset("NVFP4"), tmp_path / "moe", method=method, calibration=CALIBRATION)
    state = load_file(str(tmp_path / "moe" / "model.safetensors"))
    scales = {k[: -len(".input_global_scale")]: v for k, v in state.items() if k.endswith(".input_global_scale")}
    assert len(scales) == 2 * (4 + 4 * 3) and not any(k.endswith("mlp.gate") for k in scales)
    for layer in range(2):
        for e in range(4):
            prefix = f"model.layers.{layer}.mlp.experts.{e}"
            assert torch.equal(scales[f"{prefix}.gate_proj"], scales[f"{prefix}.up_proj"])
    attn_in = _hooked_inputs(_tiny_moe() if method == "rtn" else model, CALIBRATION)["model.layers.1.self_attn.q_proj"]
    assert torch.equal(scales["model.layers.1.self_attn.k_proj"],
                       generate_gparam(attn_in.min().reshape(1), attn_in.max().reshape(1)))
    assert torch.isfinite(quantkit.load(tmp_path / "moe", dtype="float32")(CALIBRATION[:1]).logits).all()
