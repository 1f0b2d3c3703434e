"""A float preset streamed from the model's files (`--streaming`: one decoder layer in memory at a time, #47)
writes the bytes the in-memory run writes: round-to-nearest as a pipeline step (`quantizers.rtn_float`), GPTQ
(with the static input scales its pass observes), W4AFP8's integer steps, a MoE model's experts (fused from their
per-expert tensors by the streamed reader); a streamed run stopped after a layer resumes to the same bytes; what it
cannot do is refused in one line."""
from pathlib import Path

import pytest

import quantkit
from test_robustness import tree_sha256 as _tree
from quantkit.errors import QuantkitError

pytest.importorskip("compressed_tensors")

CALIBRATION = dict(num_samples=4, seq_len=32, seed=1, progress=False)


@pytest.mark.parametrize("scheme,method", [
    ("FP8_DYNAMIC", "rtn"),  # per-channel FP8, no calibration: the streamed step rounds as the in-memory writer
    ("FP8_BLOCK", "rtn"),
    ("NVFP4A16", "rtn"),  # NVFP4's fused q/k/v and gate/up share a global scale inside each streamed layer
    ("MXFP4A16", "rtn"),
    ("NVFP4", "gptq"),  # static input global scales from the absmax GPTQ's pass observed, read back per layer
    ("FP8", "gptq"),
    ("W4AFP8", "gptq"),  # the integer weights
])
def test_a_streamed_float_run_writes_the_in_memory_bytes(tmp_path, tiny_llama_128_dir, scheme, method):
    src = str(tiny_llama_128_dir)
    cal = CALIBRATION if method != "rtn" else dict(progress=False)
    quantkit.quantize(src, method, scheme=scheme, output=tmp_path / "memory", streaming=False, **cal)
    result = quantkit.quantize(src, method, scheme=scheme, output=tmp_path / "streamed", streaming=True, **cal)
    assert result.summary["streaming"] is True
    assert _tree(tmp_path / "streamed") == _tree(tmp_path / "memory")
    assert not list(tmp_path.glob(".*")), list(tmp_path.glob(".*"))  # no staging or scratch folder left


def test_a_streamed_float_run_in_shards_writes_the_in_memory_shards(tmp_path, tiny_llama_128_dir):
    """Sharded output: the tensors' order (which tensor lands in which shard) is the in-memory writer's."""
    src = str(tiny_llama_128_dir)
    for name, streaming in (("memory", False), ("streamed", True)):
        quantkit.quantize(src, "rtn", scheme="NVFP4A16", output=tmp_path / name, streaming=streaming,
                          max_shard_size="2MB", progress=False)
    tree = _tree(tmp_path / "streamed")
    assert "model.safetensors.index.json" in tree and len([k for k in tree if k.endswith(".safetensors")]) > 2
    assert tree == _tree(tmp_path / "memory")


def _tiny_qwen3_moe(folder: Path, demo_dir: Path, hidden: int = 64) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(hidden_size=hidden, intermediate_size=128, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=4, num_experts_per_tok=2, vocab_size=49152, head_dim=16,
                                      max_position_embeddings=256)
    transformers.AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(demo_dir).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("scheme,method", [("FP8_DYNAMIC", "rtn"), ("NVFP4A16", "gptq")])
def test_a_streamed_float_moe_writes_the_in_memory_bytes(tmp_path, demo_dir, scheme, method):
    """A Qwen3-MoE's experts: fused in transformers, per expert in its files, fused again by the streamed reader
    one layer at a time (`streaming.LazyLayers`), calibrated per expert and written per expert."""
    src = _tiny_qwen3_moe(tmp_path / "moe", demo_dir)
    cal = CALIBRATION if method != "rtn" else dict(progress=False)
    for name, streaming in (("memory", False), ("streamed", True)):
        quantkit.quantize(str(src), method, scheme=scheme, output=tmp_path / name, streaming=streaming, **cal)
    assert _tree(tmp_path / "streamed") == _tree(tmp_path / "memory")


def test_a_streamed_float_run_resumes_to_the_same_bytes(tmp_path, monkeypatch, tiny_llama_128_dir):
    from test_float_resume import _interrupted

    src, out = str(tiny_llama_128_dir), tmp_path / "out"
    quantkit.quantize(src, "rtn", scheme="NVFP4A16", output=tmp_path / "whole", streaming=True, progress=False)
    _interrupted(monkeypatch, lambda: quantkit.quantize(src, "rtn", scheme="NVFP4A16", output=out, streaming=True,
                                                        progress=False), 1)
    assert len(list((tmp_path / ".out.partial").rglob("layer-*.safetensors"))) == 1 and not out.exists()
    quantkit.quantize(src, "rtn", scheme="NVFP4A16", output=out, streaming=True, resume=True, progress=False)
    assert _tree(out) == _tree(tmp_path / "whole")


@pytest.mark.parametrize("scheme,method,words", [
    ("NVFP4", "smoothquant,gptq", "--method smoothquant transforms the whole model"),
    ("NVFP4", None, r"--method smoothquant \(the default for --scheme NVFP4\) transforms"),
    ("FP8", "rtn", "static input scales on a forward of the whole model"),
])
def test_what_a_streamed_float_run_cannot_do_is_refused(tmp_path, tiny_llama_128_dir, scheme, method, words):
    out = tmp_path / "out"
    with pytest.raises(QuantkitError, match=words) as err:
        quantkit.quantize(str(tiny_llama_128_dir), method, scheme=scheme, output=out, streaming=True, **CALIBRATION)
    assert "\n" not in str(err.value) and "drop --streaming" in str(err.value)
    assert not list(tmp_path.iterdir())


def test_a_streamed_float_run_with_kv_cache_scales_is_refused(tmp_path, tiny_llama_128_dir):
    with pytest.raises(QuantkitError, match="--kv-cache-scheme observes the whole model"):
        quantkit.quantize(str(tiny_llama_128_dir), "gptq", scheme="FP8_DYNAMIC", output=tmp_path / "o", streaming=True,
                          kv_cache_scheme="fp8", **CALIBRATION)
    assert not list(tmp_path.iterdir())


def test_float_layers_placed_in_host_memory_and_on_disk_write_the_plain_checkpoint(tmp_path, tmp_path_factory):
    """`--device-map auto` with 28 MB of host memory (the 25 MB embedding and two decoder layers; accelerate puts
    the other four on disk, streamed from there): the plain run's bytes."""
    from conftest import last_json, run_cli
    from test_robustness import random_llama_with_demo_tokenizer, tree_sha256

    src = random_llama_with_demo_tokenizer(tmp_path_factory, "placed-float-llama", layers=6, hidden=128,
                                           intermediate=384, layers_per_shard=3, seed=1)
    args = ["--model", src, "--scheme", "NVFP4A16", "--method", "gptq", "--num-samples", "8", "--seq-len", "64",
            "--json"]
    plain = run_cli("quantize", *args, "--output", tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    placed = run_cli("quantize", *args, "--device-map", "auto", "--max-memory", "cpu=28MB", "--output",
                     tmp_path / "placed")
    assert placed.returncode == 0, placed.stderr[-3000:]
    assert last_json(placed.stdout)["placement"] == {"cpu": 2, "disk": 4}
    assert tree_sha256(tmp_path / "placed") == tree_sha256(tmp_path / "plain")
