"""A tiny model written with a float preset (#47) and read back by transformers + compressed-tensors (the
oracle): the weights compressed-tensors decompresses are exactly the ones quantkit dequantized."""
import json

import pytest
import torch
import transformers

from quantkit.errors import QuantkitError
from quantkit.float_checkpoint import WRITABLE, read_dequantized, write
from quantkit.scheme_presets import preset

pytest.importorskip("compressed_tensors")


def _tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=128, tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _decompressed_by_compressed_tensors(folder, weights: dict, name: str):
    """Load `folder` through transformers + compressed-tensors' own decompression and assert every
    linear in `weights` came back exactly; returns the loaded model."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False))
    for module_name, w in weights.items():
        got = loaded.get_submodule(module_name).weight.detach()
        # compressed-tensors decompresses FP4 layouts in bfloat16 (quantkit's values are exact there) and int4
        # (W4AFP8) in its scales' float16, which rounds the products quantkit keeps in float32
        rounding = torch.bfloat16 if "FP4" in name else torch.float16 if name == "W4AFP8" else got.dtype
        want = w.to(rounding).to(got.dtype)
        assert torch.equal(got, want), module_name
    return loaded


@pytest.mark.parametrize("name", WRITABLE)
def test_compressed_tensors_decompresses_quantkits_weights(tmp_path, name):
    model = _tiny_llama()
    out = tmp_path / name
    shapes = write(model, preset(name), out, calibration=_calibration(name))
    ours = read_dequantized(out)  # the weights quantkit's packers read back
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["ignore"] == ["lm_head"] and len(ours) == 7
    assert shapes == {n: tuple(model.get_submodule(n).weight.shape) for n in ours}
    loaded = _decompressed_by_compressed_tensors(out, ours, name)
    for module_name in ours:
        got = loaded.get_submodule(module_name).weight.detach()
        original = model.get_submodule(module_name).weight.detach()
        assert not torch.equal(got, original)  # really quantized
        rel = (got.float() - original).norm() / original.norm()
        assert rel < (0.2 if preset(name).weights.bits == 4 else 0.05), (module_name, float(rel))


def _calibration(name):
    """Calibration token ids for the presets whose checkpoint stores measured input scales (FP8, NVFP4)."""
    if not preset(name).calibrates_activations:
        return None
    return torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", ["FP8_BLOCK", "MXFP4XFP8"])
def test_inputs_that_do_not_divide_into_the_activation_groups_are_refused_before_any_work(tmp_path, name):
    """The demo's 576-wide inputs in FP8 groups of 128: compressed-tensors' own forward cannot split them either."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    cfg = transformers.LlamaConfig(hidden_size=96, intermediate_size=256, num_hidden_layers=1, num_attention_heads=3,
                                   num_key_value_heads=1, vocab_size=256, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(QuantkitError, match=f"--scheme {name} quantizes each linear's inputs in groups of 128; "
                                            "model.layers.0.self_attn.q_proj's input size 96 is not a multiple of 128"):
        write(model, preset(name), tmp_path / name)
    assert not any(tmp_path.iterdir())
    acts = QuantizationArgs(num_bits=8, type="float", strategy="group", group_size=128, dynamic=True)
    with pytest.raises(RuntimeError):  # the oracle: compressed-tensors cannot quantize such an input at all
        compute_dynamic_scales_and_zp(torch.randn(2, 96), acts, torch.nn.Linear(96, 8))


def test_what_cannot_be_written_is_refused_with_the_reason(tmp_path):
    for name in ("FP8", "NVFP4"):
        with pytest.raises(QuantkitError, match=f"--scheme {name} stores input scales measured on calibration data; "
                                                "it needs calibration token ids with --method rtn as with gptq"):
            write(_tiny_llama(), preset(name), tmp_path / name)
        assert not (tmp_path / name).exists()
    with pytest.raises(QuantkitError, match="--scheme W4A16 is not written by quantkit.float_checkpoint"):
        write(_tiny_llama(), preset("W4A16"), tmp_path / "W4A16")
    with pytest.raises(QuantkitError, match="--scheme NVFP4 is written with --method rtn, gptq, gptq\\+signround, "
                                            "smoothquant, smoothquant\\+gptq, smoothquant\\+gptq\\+signround, awq, "
                                            "awq\\+gptq, awq\\+gptq\\+signround, not 'signround'"):
        write(_tiny_llama(), preset("NVFP4"), tmp_path / "awq", method="signround", calibration=_calibration("NVFP4"))
    with pytest.raises(QuantkitError, match="round-to-nearest onto --scheme W4AFP8 reads no calibration data"):
        write(_tiny_llama(), preset("W4AFP8"), tmp_path / "w4", calibration=_calibration("FP8"))
    assert not any(tmp_path.iterdir())
    (tmp_path / "taken").mkdir()
    with pytest.raises(QuantkitError, match="already exists"):
        write(_tiny_llama(), preset("NVFP4A16"), tmp_path / "taken")


@pytest.mark.parametrize("name", WRITABLE)
def test_quantkit_reads_back_what_it_wrote(tmp_path, name):
    """The reader and the runtime's loader give the same weights (compressed-tensors' agree with the reader's:
    the test above), and round-to-nearest's own weights where the writer rounds them alone (weight-only)."""
    import quantkit
    from quantkit.float_checkpoint import quantize_weight
    from quantkit.runtime.float_linear import FloatLinear

    model = _tiny_llama()
    write(model, preset(name), tmp_path / name, calibration=_calibration(name))
    back = read_dequantized(tmp_path / name)
    loaded = {n: m for n, m in quantkit.load(tmp_path / name).named_modules() if isinstance(m, FloatLinear)}
    assert sorted(back) == sorted(loaded) and len(back) == 7
    for module_name, w in back.items():
        assert torch.equal(loaded[module_name].dequantized_weight(), w), module_name
    if preset(name).weights.kind == "float" and preset(name).weights.strategy != "tensor_group":  # no shared scale
        for module_name, w in back.items():
            assert torch.equal(quantize_weight(model.get_submodule(module_name).weight, preset(name))[1], w)


def _fused_siblings(model, module_name):
    """The weights that share module_name's NVFP4 global scale (llm-compressor's FUSED_LAYER_NAMES)."""
    parent, _, child = module_name.rpartition(".")
    for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        if child in group:
            return [model.get_submodule(f"{parent}.{c}").weight for c in group]
    return [model.get_submodule(module_name).weight]


@pytest.mark.parametrize("name", ["NVFP4A16", "MXFP4A16", "MXFP8A16", "FP8_DYNAMIC", "FP8_BLOCK"])
def test_quantkit_reads_a_checkpoint_compressed_tensors_wrote(tmp_path, name):
    """compressed-tensors writes (its apply_quantization_config + ModelCompressor, scales from its own
    calculate_qparams / generate_gparam, as llm-compressor's RTN would); quantkit's reader must get exactly the
    weights compressed-tensors itself decompresses."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    from quantkit.float_checkpoint import read_dequantized

    model = _tiny_llama()
    scheme = preset_name_to_scheme(name, ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    args = scheme.weights
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear) or module_name == "lm_head":
                continue
            w = module.weight
            global_scale = None
            if hasattr(module, "weight_global_scale"):  # one over q/k/v and over gate/up, as llm-compressor fuses
                fused = _fused_siblings(model, module_name)
                global_scale = generate_gparam(torch.stack([x.amin() for x in fused]).amin(),
                                               torch.stack([x.amax() for x in fused]).amax())
                module.weight_global_scale.copy_(global_scale)
            if args.strategy in ("group", "tensor_group"):
                g = w.reshape(w.shape[0], -1, args.group_size)
                lo, hi = g.amin(-1), g.amax(-1)
            elif args.strategy == "block":
                nb, kb = -(-w.shape[0] // 128), -(-w.shape[1] // 128)  # k/v_proj have 64 rows: zero-pad
                padded = torch.nn.functional.pad(w, (0, kb * 128 - w.shape[1], 0, nb * 128 - w.shape[0]))
                b = padded.reshape(nb, 128, kb, 128)
                lo, hi = b.amin(dim=(1, 3)), b.amax(dim=(1, 3))
            else:
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            scale, _ = calculate_qparams(lo, hi, args, global_scale=global_scale)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    out = tmp_path / f"ct-{name}"
    model.save_pretrained(out)
    compressor.update_config(out)

    ours = read_dequantized(out)
    assert len(ours) == 7
    import quantkit
    from quantkit.runtime.float_linear import FloatLinear

    loaded = {n: m for n, m in quantkit.load(out).named_modules() if isinstance(m, FloatLinear)}
    assert sorted(loaded) == sorted(ours) and all(torch.equal(loaded[m].dequantized_weight(), ours[m]) for m in ours)
    # quantkit's own RTN of the same model, on the absmax scales (no range search), gives the same weights
    # compressed-tensors wrote
    write(_tiny_llama(), preset(name), tmp_path / f"qk-{name}", options={"mse": False})
    written = read_dequantized(tmp_path / f"qk-{name}")
    assert all(torch.equal(written[m], ours[m]) for m in ours)
    _decompressed_by_compressed_tensors(out, ours, name)


def test_reader_refuses_what_it_cannot_read(tmp_path):
    from quantkit.float_checkpoint import read_dequantized

    with pytest.raises(QuantkitError, match="no readable config.json"):
        read_dequantized(tmp_path)
    write(_tiny_llama(), preset("NVFP4A16"), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantkitError, match="disagrees with itself: nvfp4-pack-quantized stores FP4"):
        read_dequantized(tmp_path / "m")


def test_reader_refuses_a_damaged_safetensors_file(tmp_path):
    from quantkit.float_checkpoint import read_dequantized

    write(_tiny_llama(), preset("MXFP4A16"), tmp_path / "m")
    data = (tmp_path / "m" / "model.safetensors").read_bytes()
    (tmp_path / "m" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(QuantkitError, match="cannot read model.safetensors: .*damaged"):
        read_dequantized(tmp_path / "m")


def test_reader_reads_only_the_files_the_folder_names_and_nothing_outside_it(tmp_path):
    """A float checkpoint is untrusted input like any other: a planted *.safetensors beside the weights is
    not read (it would overwrite the real tensors), and a file linked from outside the folder is refused."""
    from safetensors.torch import save_file

    from quantkit.float_checkpoint import read_dequantized

    write(_tiny_llama(), preset("FP8_DYNAMIC"), tmp_path / "m")
    before = read_dequantized(tmp_path / "m")
    name = sorted(before)[0]
    save_file({f"{name}.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn),
               f"{name}.weight_scale": torch.ones(4, 1)}, str(tmp_path / "m" / "zz-planted.safetensors"))
    after = read_dequantized(tmp_path / "m")
    assert all(torch.equal(before[k], after[k]) for k in before)
    (tmp_path / "m" / "zz-planted.safetensors").unlink()
    outside = tmp_path / "outside.safetensors"
    (tmp_path / "m" / "model.safetensors").rename(outside)
    (tmp_path / "m" / "model.safetensors").symlink_to(outside)
    with pytest.raises(QuantkitError, match="outside the model folder"):
        read_dequantized(tmp_path / "m")


def _bf16_source(folder, tokenizer_dir):
    """The tiny Llama stored in bfloat16, as most Hub checkpoints are (with the demo's tokenizer)."""
    _tiny_llama().to(torch.bfloat16).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


def _tensors(folder) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("model*.safetensors")):
        out.update(load_file(f))
    return out


def test_a_float_run_keeps_the_sources_dtype_and_shards_as_asked(tmp_path, demo_dir):
    """The tensors a float preset leaves unquantized are written in the source's dtype (bf16 here: exactly the
    source's values, read back by safetensors) unless --dtype says otherwise; --max-shard-size splits the files
    as for the integer schemes, and the shards hold exactly the single file's tensors (transformers +
    compressed-tensors load both to the same model); --resume with nothing to resume writes the same bytes
    (interrupted float runs: test_float_resume.py)."""
    import quantkit
    from safetensors.torch import load_file

    src = _bf16_source(tmp_path / "src", demo_dir)
    source = load_file(src / "model.safetensors")
    quantkit.quantize(str(src), "rtn", scheme="FP8_DYNAMIC", output=tmp_path / "one", progress=False)
    one = _tensors(tmp_path / "one")
    assert [p.name for p in (tmp_path / "one").glob("model*.safetensors")] == ["model.safetensors"]
    assert one["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(one["model.embed_tokens.weight"], source["model.embed_tokens.weight"])
    assert torch.equal(one["model.norm.weight"], source["model.norm.weight"])
    assert one["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn  # the layout's own dtype
    assert json.loads((tmp_path / "one" / "config.json").read_text())["dtype"] == "bfloat16"

    quantkit.quantize(str(src), "rtn", scheme="FP8_DYNAMIC", output=tmp_path / "shards", max_shard_size="40KB",
                      progress=False)
    shards = sorted(p.name for p in (tmp_path / "shards").glob("model*.safetensors"))
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    split = _tensors(tmp_path / "shards")
    assert split.keys() == one.keys() and all(torch.equal(split[k], one[k]) for k in one)
    config = transformers.CompressedTensorsConfig(run_compressed=False)
    a, b = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / d, dtype=torch.float32,
                                                              quantization_config=config).state_dict()
            for d in ("one", "shards"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    quantkit.quantize(str(src), "rtn", scheme="FP8_DYNAMIC", output=tmp_path / "f32", dtype="float32", progress=False)
    assert _tensors(tmp_path / "f32")["model.embed_tokens.weight"].dtype == torch.float32
    quantkit.quantize(str(src), "rtn", scheme="FP8_DYNAMIC", output=tmp_path / "again", resume=True, progress=False)
    again = _tensors(tmp_path / "again")
    assert again.keys() == one.keys() and all(torch.equal(again[k], one[k]) for k in one)
    assert not list(tmp_path.glob(".again*"))
