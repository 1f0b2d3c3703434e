"""Calibrated FP8 KV-cache scales (#47, `quantize --kv-cache-scheme`): observed after RoPE, written as
compressed-tensors declares them, read back by compressed-tensors itself, and used by quantkit's engine.

Oracles: keys and values recorded inside transformers' own attention forward (an attention function
registered with transformers' AttentionInterface, which receives the states after RoPE), compressed-tensors'
QuantizationConfig and its loader, and a plain PyTorch e4m3 rounding of the cached states."""
import json

import pytest
import torch
import transformers

from quantkit.errors import QuantkitError
from quantkit.kv_calibration import calibrate_kv_scales, parse_kv_cache_scheme
from tiny_models import ForcingSampler, greedy, tiny_model

_RECORDED: dict = {}


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, recording the key/value states it is given (keys after RoPE), or
    attending over them rounded to e4m3 on `_RECORDED['fake_quant']`'s scales [layers, kv_heads]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    i = module.layer_idx
    fq = _RECORDED.get("fake_quant")
    if fq is not None:
        ks, vs = (s[i].view(1, -1, 1, 1) for s in fq)
        key = ((key / ks).clamp(-448, 448).to(torch.float8_e4m3fn).float() * ks).to(key.dtype)
        value = ((value / vs).clamp(-448, 448).to(torch.float8_e4m3fn).float() * vs).to(value.dtype)
    else:
        _RECORDED.setdefault(i, []).append((key.detach().clone(), value.detach().clone()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


transformers.AttentionInterface.register("kv_recording", _recording_attention)


def _ids(n=5, t=24, seed=1):
    return torch.randint(3, 256, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_scales_are_the_absmax_of_the_keys_after_rope_and_the_values(kind):
    model = tiny_model(kind)
    ids = _ids()
    scales = calibrate_kv_scales(model, ids, parse_kv_cache_scheme("fp8-head"), batch_size=2)
    _RECORDED.clear()
    model.set_attn_implementation("kv_recording")
    with torch.no_grad():
        model(input_ids=ids)
    layers = model.config.num_hidden_layers
    k_amax = torch.stack([_RECORDED[i][0][0].abs().amax(dim=(0, 2, 3)) for i in range(layers)])
    v_amax = torch.stack([_RECORDED[i][0][1].abs().amax(dim=(0, 2, 3)) for i in range(layers)])
    torch.testing.assert_close(scales.k, k_amax / 448, rtol=1e-6, atol=0)
    torch.testing.assert_close(scales.v, v_amax / 448, rtol=1e-6, atol=0)
    # the states the calibration observes are those transformers' attention receives (keys after RoPE),
    # not the k_proj outputs before rotation
    from quantkit.kv_calibration import tap_kv_states

    seen, pre_rope = {}, {}
    hooks = [layer.self_attn.k_proj.register_forward_hook(lambda m, a, out, i=i: pre_rope.__setitem__(i, out))
             for i, layer in enumerate(model.model.layers)]
    with tap_kv_states(model, lambda i, k, v: seen.__setitem__(i, (k.clone(), v.clone()))), torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    for i in range(layers):
        assert torch.equal(seen[i][0], _RECORDED[i][0][0]) and torch.equal(seen[i][1], _RECORDED[i][0][1])
        b, t, _ = pre_rope[i].shape
        unrotated = pre_rope[i].view(b, t, -1, seen[i][0].shape[-1]).transpose(1, 2)
        if kind == "llama":  # qwen3 normalises k per head before RoPE
            assert torch.equal(unrotated[:, :, 0], seen[i][0][:, :, 0])  # position 0: no rotation
        assert not torch.allclose(unrotated[:, :, 1:], seen[i][0][:, :, 1:])
    # per tensor: the largest head's
    per_tensor = calibrate_kv_scales(model, ids, parse_kv_cache_scheme("fp8"), batch_size=5)
    tensors = per_tensor.tensors()
    assert tensors["model.layers.0.self_attn.k_scale"].shape == (1,)
    torch.testing.assert_close(tensors["model.layers.1.self_attn.v_scale"], v_amax[1].max().reshape(1) / 448,
                               rtol=1e-6, atol=0)
    assert scales.tensors()["model.layers.0.self_attn.k_scale"].shape == (2, 1, 1)


def _written(tmp_path, scheme="fp8-head", name="FP8_DYNAMIC", layers=2):
    from quantkit.float_checkpoint import write
    from quantkit.scheme_presets import preset

    model = tiny_model("llama", num_hidden_layers=layers)
    scales = calibrate_kv_scales(model, _ids(), parse_kv_cache_scheme(scheme))
    out = tmp_path / f"{name}-{scheme}"
    write(model, preset(name), out, kv_scales=scales)
    return model, scales, out


@pytest.mark.parametrize("scheme", ["fp8", "fp8-head"])
def test_config_and_tensors_are_what_compressed_tensors_reads(tmp_path, scheme):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    _, scales, out = _written(tmp_path, scheme)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qcfg)
    kv = parsed.kv_cache_scheme
    assert (kv.num_bits, kv.type, kv.symmetric, kv.dynamic, kv.strategy) == \
        (8, "float", True, False, "tensor" if scheme == "fp8" else "attn_head")
    stored = load_file(str(out / "model.safetensors"))
    # compressed-tensors' own parameters for this kv_cache_scheme (initialize_qparams: name and shape from the
    # scheme and the config's KV heads), filled from the checkpoint by name with nothing left over. (Its
    # apply_quantization_config finds no cached attention in transformers 5.25, whose attention forward takes
    # `cache`, not `past_key_values`, so the parameters are made here as it would make them.)
    from compressed_tensors.quantization import initialize_qparams

    fresh = tiny_model("llama")
    for layer in fresh.model.layers:
        for kind in ("k", "v"):
            initialize_qparams(layer.self_attn, kind, kv, observed_shape=(2, None, 16), observed_dtype=torch.float32,
                               force_zero_point=False)
    kv_keys = {k: v for k, v in stored.items() if k.endswith(("k_scale", "v_scale"))}
    assert len(kv_keys) == 4
    missing, unexpected = fresh.load_state_dict(kv_keys, strict=False)
    assert not unexpected and not any(k.endswith(("k_scale", "v_scale")) for k in missing)
    for i, layer in enumerate(fresh.model.layers):
        for kind in ("k", "v"):
            got = getattr(layer.self_attn, f"{kind}_scale").detach()
            mine = getattr(scales, kind)[i]
            assert torch.equal(got.flatten(), mine if scheme == "fp8-head" else mine.amax().reshape(1))


def test_engine_uses_the_calibrated_scales(tmp_path):
    """Teacher-forced decode (every K/V read back from the paged fp8 cache) equals transformers' forward with
    the keys and values rounded to e4m3 on the checkpoint's scales (plain PyTorch) within fp32 noise (1e-4:
    the same arithmetic in another order), while it differs from the model-dtype cache's (the rounding is real).
    How close to the model-dtype cache that is on real text is scripts/bench_kv_cache.py's KL.
    One decoder layer: the engine's prefill attends over fresh K/V (like vLLM), so with more layers the first
    token's deeper K/V would differ from a forward that rounds every layer's cache."""
    from quantkit.api import load
    from quantkit.engine import LLMEngine

    _, scales, out = _written(tmp_path, "fp8-head", layers=1)
    model = load(str(out))
    assert tuple(model.kv_cache_scales[0].shape) == (1, 2)
    torch.testing.assert_close(model.kv_cache_scales[0], scales.k)
    x = _ids(1, 20, seed=7)

    def decode_logits(kv):
        eng = LLMEngine(model, block_size=4, num_kv_blocks=8, kv_cache_dtype=kv)
        eng.sampler = ForcingSampler(x[0, 1:].tolist())
        eng.generate([x[0, :1].tolist()], greedy(x.shape[1] - 1, ignore_eos=True))
        return eng, torch.stack(eng.sampler.logits)

    eng, got = decode_logits("fp8")
    assert eng.kv_cache.name == "fp8_e4m3_static"
    _, exact = decode_logits("auto")
    _, dynamic = decode_logits("int8")
    _RECORDED.clear()
    _RECORDED["fake_quant"] = (scales.k, scales.v)
    try:
        model.set_attn_implementation("kv_recording")
        with torch.no_grad():
            want = model(input_ids=x).logits[0, :-1].float()
    finally:
        _RECORDED.clear()
        model.set_attn_implementation("sdpa")
    # the first position is the prefill's, over fresh (unquantized) K/V
    torch.testing.assert_close(got[1:], want[1:], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got[1:], exact[1:], atol=1e-4, rtol=1e-4)  # the cache really was fp8
    assert float((dynamic - exact).abs().max()) > 0  # int8 stays dynamic: the scales are fp8's
    # the dynamic fp8 cache on a checkpoint without scales is unchanged
    del model.kv_cache_scales
    eng = LLMEngine(model, block_size=4, num_kv_blocks=8, kv_cache_dtype="fp8")
    assert eng.kv_cache.name == "fp8_e4m3" and eng.kv_cache.static_scales is None


def test_loader_refuses_damaged_kv_scales(tmp_path):
    from safetensors.torch import load_file, save_file

    from quantkit.api import load

    _, _, out = _written(tmp_path, "fp8")
    state = load_file(str(out / "model.safetensors"))
    state["model.layers.1.self_attn.v_scale"] = torch.tensor([-1.0])
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(QuantkitError, match="v_scale holds a scale that is not a positive finite number"):
        load(str(out))
    del state["model.layers.1.self_attn.v_scale"]
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(QuantkitError, match="missing tensor model.layers.1.self_attn.v_scale"):
        load(str(out))


def test_unknown_kv_cache_scheme_is_refused():
    with pytest.raises(QuantkitError, match="use fp8 .* or fp8-head"):
        parse_kv_cache_scheme("int8")


def test_quantize_writes_kv_scales_from_the_runs_tokens(tiny_llama_dir, tmp_path):
    """quantize(scheme=..., kv_cache_scheme=...) on a folder: the scales written are the ones calibrated on the
    run's tokens (same tokens, same model), and quantkit.load hands them to the engine."""
    import quantkit
    from safetensors.torch import load_file

    ids = torch.randint(3, 49152, (4, 32), generator=torch.Generator().manual_seed(3))
    out = tmp_path / "fp8-kv"
    quantkit.quantize(str(tiny_llama_dir), scheme="fp8_dynamic", kv_cache_scheme="FP8-head", dataset=ids,
                      output=out, progress=False)
    want = calibrate_kv_scales(transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir), ids,
                               parse_kv_cache_scheme("fp8-head"))
    stored = load_file(str(out / "model.safetensors"))
    assert torch.equal(stored["model.layers.1.self_attn.v_scale"], want.v[1].reshape(2, 1, 1))
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["kv_cache_scheme"]["strategy"] == "attn_head"
    torch.testing.assert_close(quantkit.load(str(out)).kv_cache_scales[0], want.k)


@pytest.mark.parametrize("flags, reason", [
    (dict(format="gptq"), "the gptq format has no place for KV-cache scales"),
    (dict(format="awq", method="awq"), "the awq format has no place for KV-cache scales"),
    (dict(format="gguf"), "the gguf format has no place for KV-cache scales"),
])
def test_formats_that_cannot_carry_kv_scales_refuse(flags, reason):
    from quantkit.plan import resolve_plan

    with pytest.raises(QuantkitError, match=reason + r".*use --format compressed-tensors"):
        resolve_plan(flags.pop("method", None), kv_cache_scheme="fp8", **flags)
    assert resolve_plan(None, scheme="FP8_DYNAMIC", kv_cache_scheme="fp8").kv_cache.strategy == "tensor"


def test_cli_refuses_kv_scheme_where_it_cannot_be_written_in_one_line(tiny_llama_dir, tmp_path, capsys):
    from quantkit.cli import main

    for args, reason in ((["--format", "compressed-tensors", "--streaming"], "drop --streaming / --nproc"),
                         (["--method", "gptq"], "the gptq format has no place for KV-cache scales")):
        with pytest.raises(SystemExit) as exc:
            main(["quantize", "--model", str(tiny_llama_dir), "--kv-cache-scheme", "fp8", *args,
                  "--output", str(tmp_path / "x")])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and reason in err and err.count("\n") == 1
        assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("method, scheme", [("rtn", "fp8-head"), ("gptq", "fp8")])
def test_integer_compressed_tensors_writer_carries_kv_scales(tiny_llama_dir, tmp_path, method, scheme):
    """W4A16 (the integer compressed-tensors writer, RTN and GPTQ) with --kv-cache-scheme: the scales are the
    source model's on the run's tokens (observed before any layer is quantized), the config validates as
    compressed-tensors' with its kv_cache_scheme, quantkit.load hands them to the engine, and the quantized
    weights are byte for byte those of the same run without KV scales."""
    pytest.importorskip("compressed_tensors")
    import quantkit
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    ids = torch.randint(3, 49152, (4, 32), generator=torch.Generator().manual_seed(5))
    run = dict(method=method, format="compressed-tensors", bits=4, group_size=32, dataset=ids, progress=False)
    quantkit.quantize(str(tiny_llama_dir), kv_cache_scheme=scheme, output=tmp_path / "kv", **run)
    if method == "rtn":
        run = {k: v for k, v in run.items() if k != "dataset"}  # RTN without KV scales reads no data
    quantkit.quantize(str(tiny_llama_dir), output=tmp_path / "plain", **run)
    want = calibrate_kv_scales(transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir), ids,
                               parse_kv_cache_scheme(scheme))
    stored, plain = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("kv", "plain"))
    kv_keys = {k for k in stored if k.endswith(("k_scale", "v_scale"))}
    assert kv_keys == {f"model.layers.{i}.self_attn.{k}_scale" for i in range(2) for k in "kv"}
    for i in range(2):
        for kind in "kv":
            t = stored[f"model.layers.{i}.self_attn.{kind}_scale"]
            mine = getattr(want, kind)[i]
            assert t.dtype == torch.float32
            assert torch.equal(t.flatten(), mine if scheme == "fp8-head" else mine.amax().reshape(1))
    assert stored.keys() - kv_keys == plain.keys()
    assert all(torch.equal(stored[k], plain[k]) for k in plain)
    qcfg = json.loads((tmp_path / "kv" / "config.json").read_text())["quantization_config"]
    kv = QuantizationConfig.model_validate(qcfg).kv_cache_scheme
    assert (kv.num_bits, kv.type, kv.dynamic, kv.strategy) == \
        (8, "float", False, "tensor" if scheme == "fp8" else "attn_head")
    assert "KV cache: FP8" in (tmp_path / "kv" / "README.md").read_text()
    loaded = quantkit.load(str(tmp_path / "kv")).kv_cache_scales
    torch.testing.assert_close(loaded[0], want.k if scheme == "fp8-head" else want.k.amax(1, keepdim=True)
                               .expand_as(want.k))


def test_recipe_yaml_records_the_kv_cache_scheme_and_replays_to_the_same_bytes(tiny_llama_dir, tmp_path):
    import hashlib

    import quantkit
    import yaml

    def shas(folder):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}

    quantkit.quantize(str(tiny_llama_dir), scheme="FP8_DYNAMIC", kv_cache_scheme="fp8", dataset="lee", num_samples=2,
                      seq_len=16, output=tmp_path / "first", progress=False)
    assert yaml.safe_load((tmp_path / "first" / "recipe.yaml").read_text())["kv_cache_scheme"] == "fp8"
    quantkit.quantize(recipe=str(tmp_path / "first" / "recipe.yaml"), output=tmp_path / "again", progress=False)
    assert shas(tmp_path / "again") == shas(tmp_path / "first")
