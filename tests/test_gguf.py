"""GGUF export and reading: each block packer against gguf-py's independent numpy decoder, the
grids the quantizers target, llama-quantize's per-tensor choices, the written file read back bit
for bit (by quantkit and by gguf-py), llama.cpp's own logits (when llama-cpp-python is installed),
`quantkit convert`, and hostile GGUF files."""
from __future__ import annotations

import json
import multiprocessing
import os
import random
import resource
import shutil
import signal
import struct
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import last_json, run_cli
from quantkit.errors import QuantkitError
from quantkit.formats.gguf import blocks as gguf_blocks
from quantkit.formats.gguf.types import TYPES
from quantkit.qtensor import QuantizedWeight, TwoLevelScales

gguf = pytest.importorskip("gguf")
QUANTIZED = [n for n, t in TYPES.items() if t.quantized]


def _random_weight(t, n: int, k: int, g: torch.Generator) -> QuantizedWeight:
    """Random codes and parameters on type t's grid, covering every bit of the sub-scale fields."""
    q = torch.randint(0, 1 << t.bits, (n, k), generator=g).to(torch.uint8)
    groups = k // t.group
    zeros = torch.full((n, groups), t.zero or 0, dtype=torch.int32)
    g_idx = torch.arange(k, dtype=torch.int32) // t.group
    if t.two_level:
        d = (torch.rand(n, k // 256, generator=g) * 0.01).half().float()
        lo, hi = t.sub_range
        sc = torch.randint(lo, hi + 1, (n, groups), generator=g).short()
        sc[0, :min(groups, 2)] = torch.tensor([lo, hi][:min(groups, 2)], dtype=torch.int16)  # both extremes
        if t.zero is None:
            m = torch.randint(0, 64, (n, groups), generator=g).short()
            m[1, :2] = torch.tensor([63, 0], dtype=torch.int16)
            tl = TwoLevelScales(d=d, sc=sc, super_size=256, dmin=(torch.rand(n, k // 256, generator=g) * 0.01).half().float(), m=m)
        else:
            tl = TwoLevelScales(d=d, sc=sc, super_size=256)
        return QuantizedWeight(q, tl.scales(), zeros, g_idx, t.bits, t.group, t.zero is not None,
                               offsets=tl.offsets(), two_level=tl)
    scales = (torch.randn(n, groups, generator=g) * 0.01).half().float()
    offsets = None if t.zero is not None else (torch.randn(n, groups, generator=g) * 0.1).half().float()
    return QuantizedWeight(q, scales, zeros, g_idx, t.bits, t.group, t.zero is not None, offsets=offsets)


@pytest.mark.parametrize("name", QUANTIZED)
def test_packer_matches_gguf_py_decoder_and_unpacks_bit_for_bit(name):
    t = TYPES[name]
    qw = _random_weight(t, 6, 768, torch.Generator().manual_seed(t.id))
    raw = gguf_blocks.pack(qw, t)
    assert raw.shape == (6, t.row_bytes(768)) and raw.dtype == np.uint8
    oracle = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.id))  # gguf-py's own numpy decoder
    assert np.array_equal(oracle.view(np.uint32), qw.dequantize().numpy().view(np.uint32))
    back = gguf_blocks.unpack(raw, t, 768)
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.scales, qw.scales)
    assert torch.equal(back.dequantize(), qw.dequantize())
    if t.two_level:
        assert torch.equal(back.two_level.sc, qw.two_level.sc) and torch.equal(back.two_level.d, qw.two_level.d)
        if t.zero is None:
            assert torch.equal(back.two_level.m, qw.two_level.m)
    assert np.array_equal(gguf_blocks.pack(back, t), raw)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_types_round_trip_and_refuse_lossy_casts(name):
    t = TYPES[name]
    w = torch.randn(4, 64).to(gguf_blocks.FLOAT_TORCH[name]).float()
    raw = gguf_blocks.pack_float(w, t)
    assert np.array_equal(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.id)), w.numpy())
    assert torch.equal(gguf_blocks.unpack_float(raw, t, (4, 64)).float(), w)
    if name != "F32":
        with pytest.raises(QuantkitError, match="would change"):
            gguf_blocks.pack_float(torch.full((2, 32), 1.0 + 2 ** -20), t)


def test_layouts_refuse_what_they_cannot_hold_exactly():
    g = torch.Generator().manual_seed(0)
    asym = _random_weight(TYPES["Q4_1"], 2, 64, g)
    with pytest.raises(QuantkitError, match="zero points are not all 8"):
        gguf_blocks.pack(asym, TYPES["Q4_0"])
    with pytest.raises(QuantkitError, match="two-level|k-quant"):
        gguf_blocks.pack(_random_weight(TYPES["Q4_0"], 2, 256, g), TYPES["Q4_K"])
    from quantkit.formats import get_format

    for fmt in ("gptq", "awq", "compressed-tensors"):
        with pytest.raises(QuantkitError, match="float-offset or two-level"):
            get_format(fmt).pack(asym)
    sym = _random_weight(TYPES["Q4_0"], 2, 64, g)
    sym.scales[0, 0] = 0.1  # not an fp16 value
    with pytest.raises(QuantkitError, match="not float16"):
        gguf_blocks.pack(sym, TYPES["Q4_0"])


def test_integer_zero_grid_becomes_q4_1_exactly_when_the_min_is_fp16():
    """A gptq-style asymmetric group (s, z) is s*q + m with m = -s*z: exact when m is an fp16 value."""
    s = torch.tensor([[0.5, 0.25]])
    qw = QuantizedWeight(torch.randint(0, 16, (1, 64), dtype=torch.uint8), s, torch.tensor([[3, 9]], dtype=torch.int32),
                         torch.arange(64, dtype=torch.int32) // 32, 4, 32, False)
    raw = gguf_blocks.pack(qw, TYPES["Q4_1"])
    assert np.array_equal(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1), qw.dequantize().numpy())


# ------------------------------------------------------------------ grids

@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_rtn_grid_is_llama_cpp_reference_quantization(name):
    """gguf-py's quantize is a port of ggml's quantize_row_*_ref: same grid and parameters, codes
    equal up to rounding ties (llama.cpp rounds with its fp32 d, quantkit with the stored fp16 d)."""
    from quantkit.quantizers.gguf_grid import rtn_on_grid

    t = TYPES[name]
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    raw = gguf_blocks.pack(rtn_on_grid(w, t), t)
    ref = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(t.id))
    blocks, ref_blocks = raw.reshape(-1, t.nbytes), ref.reshape(-1, t.nbytes)
    params = 2 if t.zero is not None else 4
    assert np.array_equal(blocks[:, :params], ref_blocks[:, :params])  # d (and m) identical
    assert np.mean(blocks == ref_blocks) > 0.99


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_grid_error_is_that_of_its_bits(name):
    """No reference quantizer for k-quants in gguf-py: check the packed result decodes (gguf-py) to
    within the per-bit error of a plain per-32 RTN, i.e. the two-level scales cost little."""
    from quantkit.quantizers.gguf_grid import rtn_on_grid
    from quantkit.quantizers.grid import rtn_quantize

    t = TYPES[name]
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(2)) * 0.02
    raw = gguf_blocks.pack(rtn_on_grid(w, t), t)
    deq = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.id)))
    plain = rtn_quantize(w, t.bits, 32, sym=t.zero is not None).dequantize()
    err, plain_err = (deq - w).square().mean(), (plain - w).square().mean()
    assert err < 1.2 * plain_err, (err, plain_err)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "Q6_K"])
def test_gptq_on_the_grid_beats_rtn_on_the_same_grid(name):
    from quantkit.quantizers.gguf_grid import choose_grid, round_to_grid
    from quantkit.quantizers.gptq_core import gptq_quantize

    t = TYPES[name]
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 256, generator=g) * 0.02
    x = torch.randn(2048, 256, generator=g) @ (torch.eye(256) + 0.3 * torch.randn(256, 256, generator=g))
    H = 2 * x.t() @ x / x.shape[0]
    grid = choose_grid(w, t)
    qw, _ = gptq_quantize(grid.shifted(w), H, t.bits, t.group, t.zero is not None, qparams=(grid.scale, grid.zero))
    gptq_w = grid.on_grid(qw.qweight)
    rtn_w = grid.on_grid(round_to_grid(w, grid))
    decoded = torch.from_numpy(gguf.quants.dequantize(gguf_blocks.pack(gptq_w, t), gguf.GGMLQuantizationType(t.id)))
    assert torch.equal(decoded, gptq_w.dequantize())  # on the grid llama.cpp decodes
    out_err = lambda m: (x @ (m - w).t()).square().mean()  # noqa: E731
    assert out_err(gptq_w.dequantize()) < 0.8 * out_err(rtn_w.dequantize())


def test_mix_plan_matches_llama_quantize_on_the_demo_shapes():
    """SmolLM2-135M (30 layers, 576 wide, ffn 1536, tied) under Q4_K_M, from llama-quant.cpp's rules:
    attn_v/ffn_down more bits on layers 0-2, 5, 8, ..., 23, 26-29; 576-wide rows fall back
    (Q4_K -> Q5_0, Q6_K -> Q8_0); the tied embedding takes the output rule (Q8_0: 576 % 256)."""
    from types import SimpleNamespace

    from quantkit.formats.gguf.plan import plan_model

    more = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
    shapes = {"model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,), "lm_head.weight": (49152, 576)}
    for i in range(30):
        for name, shape in (("self_attn.q_proj", (576, 576)), ("self_attn.k_proj", (192, 576)),
                            ("self_attn.v_proj", (192, 576)), ("self_attn.o_proj", (576, 576)),
                            ("mlp.gate_proj", (1536, 576)), ("mlp.up_proj", (1536, 576)),
                            ("mlp.down_proj", (576, 1536)), ("input_layernorm", (576,)),
                            ("post_attention_layernorm", (576,))):
            shapes[f"model.layers.{i}.{name}.weight"] = shape
    config = SimpleNamespace(model_type="llama", tie_word_embeddings=True, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3)
    types = {p.gguf_name: p.type.name for p in plan_model(shapes, config, "Q4_K_M")}
    assert "output.weight" not in types and types["token_embd.weight"] == "Q8_0"
    for i in range(30):
        assert types[f"blk.{i}.attn_v.weight"] == ("Q8_0" if i in more else "Q5_0")
        assert types[f"blk.{i}.ffn_down.weight"] == ("Q6_K" if i in more else "Q4_K")
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_up.weight"] == "Q5_0"
        assert types[f"blk.{i}.attn_norm.weight"] == "F32"
    q40 = {p.gguf_name: p.type.name for p in plan_model(shapes, config, "Q4_0")}
    assert q40["token_embd.weight"] == "Q8_0" and q40["blk.3.attn_v.weight"] == "Q4_0"
    assert {q40[f"blk.{i}.ffn_down.weight"] for i in range(30)} == {"Q4_0"}
    # with an importance matrix (a calibrated run) llama-quantize puts ffn_down of the first n/8 layers
    # (30 // 8 = 3) in Q4_1 (Q5_0 files: Q5_1); the k-quant mixes do not change
    cal = {p.gguf_name: p.type.name for p in plan_model(shapes, config, "Q4_0", calibrated=True)}
    assert [cal[f"blk.{i}.ffn_down.weight"] for i in range(5)] == ["Q4_1"] * 3 + ["Q4_0"] * 2
    assert {k: v for k, v in cal.items() if "ffn_down" not in k} == {k: v for k, v in q40.items()
                                                                     if "ffn_down" not in k}
    cal50 = {p.gguf_name: p.type.name for p in plan_model(shapes, config, "Q5_0", calibrated=True)}
    assert cal50["blk.2.ffn_down.weight"] == "Q5_1" and cal50["blk.3.ffn_down.weight"] == "Q5_0"
    assert {p.gguf_name: p.type.name for p in plan_model(shapes, config, "Q4_K_M", calibrated=True)} == types


# ------------------------------------------------------------------ written files

def _tiny_llama(out: Path, demo_dir: Path, hidden: int = 256) -> Path:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                                   max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # realistic magnitudes so every block has structure
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(demo_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny256(tmp_path_factory, demo_dir) -> Path:
    return _tiny_llama(tmp_path_factory.mktemp("tiny256"), demo_dir)


def _gguf_py_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The oracle: gguf-py's reader and decoder, attn_q/attn_k rows put back in HF order."""
    from quantkit.formats.gguf.file_io import permutation
    from quantkit.formats.gguf.plan import hf_name_of

    reader = gguf.GGUFReader(str(path))
    heads = int(reader.fields["llama.attention.head_count"].parts[-1][0])
    kv_field = reader.fields.get("llama.attention.head_count_kv")  # absent: llama.cpp uses head_count
    kv = int(kv_field.parts[-1][0]) if kv_field is not None else heads
    out = {}
    for t in reader.tensors:
        shape = tuple(reversed([int(s) for s in t.shape]))
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(shape)
        n = heads if t.name.endswith("attn_q.weight") else kv if t.name.endswith("attn_k.weight") else None
        out[hf_name_of(t.name)] = w[torch.argsort(permutation(shape[0], n))] if n else w
    return out


@pytest.mark.parametrize("method,gguf_type", [("rtn", "Q4_K_M"), ("gptq", "Q4_0")])
def test_quantize_to_gguf_reads_back_bit_for_bit(tmp_path, tiny256, method, gguf_type):
    out = tmp_path / "out"
    extra = ["--num-samples", "8", "--seq-len", "64"] if method == "gptq" else []
    proc = run_cli("quantize", "--model", tiny256, "--method", method, "--format", "gguf", "--gguf-type", gguf_type,
                   "--output", out, "--json", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_json(proc.stdout)["gguf_type"] == gguf_type
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "chat_template.jinja", "config.json", "model.gguf",
                                                     "recipe.yaml", "tokenizer.json", "tokenizer_config.json"]
    from quantkit.runtime.loader import load_model, load_tokenizer

    model = load_model(str(out))
    oracle = _gguf_py_tensors(out / "model.gguf")
    state = model.state_dict()
    for name, w in oracle.items():
        assert torch.equal(state[name], w), name
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])  # tied, as llama.cpp reuses it
    reader = gguf.GGUFReader(str(out / "model.gguf"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    expected = {"Q4_K_M": ("Q6_K", "Q4_K", "Q6_K"), "Q4_0": ("Q6_K", "Q4_0", "Q4_0")}[gguf_type]
    assert (types["token_embd.weight"], types["blk.0.attn_v.weight"], types["blk.1.attn_v.weight"]) == expected
    meta = lambda k: bytes(reader.fields[k].parts[-1]).decode()  # noqa: E731
    assert meta("tokenizer.ggml.model") == "gpt2" and meta("tokenizer.ggml.pre") == "smollm"
    assert "im_start" in meta("tokenizer.chat_template")
    assert len(reader.fields["tokenizer.ggml.merges"].data) > 40000
    tok = load_tokenizer(str(out))
    assert tok.encode("Hello world") == load_tokenizer(str(tiny256)).encode("Hello world")


def test_lossless_convert_gptq_compressed_tensors_gptq_and_lossy_refusal(tmp_path, tiny_llama_dir):
    from safetensors.torch import load_file

    src = tmp_path / "gptq"
    assert run_cli("quantize", "--model", tiny_llama_dir, "--method", "rtn", "--group-size", "32",
                   "--output", src).returncode == 0
    ct, back = tmp_path / "ct", tmp_path / "back"
    for a, fmt, b in ((src, "compressed-tensors", ct), (ct, "gptq", back)):
        proc = run_cli("convert", a, "--format", fmt, "--output", b, "--json")
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((ct / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    original, returned = load_file(str(src / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert sorted(original) == sorted(returned)
    for k in original:
        assert original[k].dtype == returned[k].dtype and torch.equal(original[k].view(torch.uint8)
                                                                        if original[k].dtype.is_floating_point
                                                                        else original[k], returned[k].view(torch.uint8)
                                                                        if returned[k].dtype.is_floating_point
                                                                        else returned[k]), k
    # the same grid as Q4_0 GGUF, read back by gguf-py equal to quantkit's dequantization
    g = tmp_path / "g"
    proc = run_cli("convert", src, "--format", "gguf", "--output", g)
    assert proc.returncode == 0, proc.stderr[-2000:]
    oracle = _gguf_py_tensors(g / "model.gguf")
    name = "model.layers.0.self_attn.q_proj"
    qweight, scales, qzeros = (original[f"{name}.{k}"] for k in ("qweight", "scales", "qzeros"))
    shifts = torch.arange(8) * 4  # plain-torch gptq v1 decode (formats.md): LSB first, zero stored minus one
    q = ((qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 15).reshape(-1, qweight.shape[1])
    z = ((qzeros.unsqueeze(2) >> shifts.view(1, 1, 8)) & 15).reshape(qzeros.shape[0], -1) + 1
    g_of = torch.arange(q.shape[0]) // 32
    want = (scales.float()[g_of] * (q.float() - z.float()[g_of])).t()
    assert torch.equal(oracle[f"{name}.weight"], want)
    assert torch.equal(oracle["model.embed_tokens.weight"], original["model.embed_tokens.weight"].float())
    # lossy: per-group fp16 scales cannot become Q4_K's two-level scales; the output is left untouched
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    proc = run_cli("convert", src, "--format", "gguf", "--gguf-type", "Q4_K", "--output", dest, "--overwrite")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Q4_K cannot hold this weight exactly" in lines[0], proc.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["keep.txt"]
    assert not any(p.name.startswith(".dest") for p in tmp_path.iterdir())


# ------------------------------------------------------------------ llama.cpp itself

def test_llama_cpp_logits_of_f32_export_match_transformers(tmp_path, tiny256):
    """The Q/K row permutation, tied embeddings and metadata, judged by llama.cpp itself."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/bench_gguf.py "
                                    "covers llama.cpp; see its header for the build)")
    import transformers

    out = tmp_path / "f32"
    proc = run_cli("convert", tiny256, "--format", "gguf", "--gguf-type", "F32", "--output", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ids = [1, 504, 3458, 314, 4256, 7, 1045, 260, 1357, 28, 90, 2111]
    # an F32 KV cache: llama.cpp's default F16 cache alone moves these logits by ~2e-3
    llm = llama_cpp.Llama(model_path=str(out / "model.gguf"), n_ctx=64, logits_all=True, n_gpu_layers=0, verbose=False,
                          n_threads=2, type_k=0, type_v=0)
    llm.reset()
    llm.eval(ids)
    got = torch.tensor(np.array(llm.scores[:len(ids)]), dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny256, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-3), (got - want).abs().max()


# ------------------------------------------------------------------ hostile files

FUZZ_TIMEOUT_S = 10
FUZZ_RSS_LIMIT_MB = 600  # growth of the reader's peak RSS allowed over a whole chunk of variants


def _fuzz_base(path: Path) -> None:
    """A 1-layer llama GGUF with one tensor of each kind of block quantkit writes (no tokenizer: the
    fuzz target is quantkit's reader of the file's structure and tensors)."""
    from quantkit.formats.gguf.file_io import permutation

    w = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in (("block_count", 1), ("embedding_length", 256), ("feed_forward_length", 256),
                       ("head_count", 4), ("head_count_kv", 2)):
        getattr(w, f"add_{key}")(value)
    w.add_string("general.name", "fuzz")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    g = torch.Generator().manual_seed(5)
    specs = [("token_embd.weight", (64, 256), "Q8_0"), ("blk.0.attn_norm.weight", (256,), "F32"),
             ("blk.0.attn_q.weight", (256, 256), "Q4_K"), ("blk.0.attn_k.weight", (128, 256), "Q5_K"),
             ("blk.0.attn_v.weight", (128, 256), "Q6_K"), ("blk.0.attn_output.weight", (256, 256), "Q4_0"),
             ("blk.0.ffn_norm.weight", (256,), "F32"), ("blk.0.ffn_gate.weight", (256, 256), "Q5_1"),
             ("blk.0.ffn_up.weight", (256, 256), "Q4_1"), ("blk.0.ffn_down.weight", (256, 256), "Q5_0"),
             ("output_norm.weight", (256,), "BF16")]
    for name, shape, tname in specs:
        t = TYPES[tname]
        if t.quantized:
            raw = gguf_blocks.pack(_random_weight(t, shape[0], shape[1], g), t)
        else:
            raw = gguf_blocks.pack_float(torch.randn(shape, generator=g).to(gguf_blocks.FLOAT_TORCH[tname]).float(), t)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(t.id))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    del permutation


def _mutations(base: bytes, path: Path):
    """(name, bytes) variants: truncations, header fields, every length, count, dim, type and offset."""
    reader = gguf.GGUFReader(str(path))
    rng = random.Random(0)
    put = lambda b, at, fmt, v: b[:at] + struct.pack(fmt, v) + b[at + struct.calcsize(fmt):]  # noqa: E731
    for i in range(40):
        yield f"truncate-{i}", base[:int(len(base) * i / 40)]
    yield "magic", b"GGUG" + base[4:]
    for v in (0, 1, 4, 0xFFFFFFFF):
        yield f"version-{v}", put(base, 4, "<I", v)
    for v in (2 ** 40, 2 ** 64 - 1, 10 ** 6, 12):
        yield f"n-tensors-{v}", put(base, 8, "<Q", v)
        yield f"n-kv-{v}", put(base, 16, "<Q", v)
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue
        at = int(field.offset)
        for v in (2 ** 62, 2 ** 32, len(base)):
            yield f"keylen-{field.name}-{v}", put(base, at, "<Q", v)
        vtype_at = at + 8 + len(field.name.encode())
        for v in (13, 99):
            yield f"vtype-{field.name}-{v}", put(base, vtype_at, "<I", v)
        if field.types and field.types[0] in (gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY):
            for v in (2 ** 61, 2 ** 40 + 7):
                yield f"vlen-{field.name}-{v}", put(base, vtype_at + 4 + (4 if field.types[0] == gguf.GGUFValueType.ARRAY else 0), "<Q", v)
    for t in reader.tensors:
        at = int(t.field.offset) + 8 + len(t.name.encode())
        dims = len(t.shape)
        type_at, off_at = at + 4 + 8 * dims, at + 4 + 8 * dims + 4
        yield f"ndims-{t.name}", put(base, at, "<I", 9)
        yield f"dim-{t.name}", put(base, at + 4, "<Q", 2 ** 40)
        yield f"dim0-{t.name}", put(base, at + 4, "<Q", 0)
        for v in (99, 15, 0, 255):
            yield f"type-{t.name}-{v}", put(base, type_at, "<I", v)
        for v in (len(base), 2 ** 63, 1, 32):
            yield f"offset-{t.name}-{v}", put(base, off_at, "<Q", v)
    for i in range(60):
        b = bytearray(base)
        at = rng.randrange(0, min(len(b), int(reader.tensors[0].data_offset) + 64))
        b[at] ^= 1 << rng.randrange(8)
        yield f"flip-{i}-{at}", bytes(b)


def _read_all(path: str) -> dict:
    from quantkit.formats.gguf.file_io import read_llama_tensors
    from quantkit.qtensor import QuantizedWeight as QW

    f, tensors = read_llama_tensors(path)
    f.close()
    return {k: (v.dequantize() if isinstance(v, QW) else v.float()) for k, v in tensors.items()}


def _fuzz_chunk(items, conn) -> None:
    """In a forked child: read each variant under a timer; report status per variant and peak RSS."""
    torch.set_num_threads(1)
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {}

    def alarm(*_):
        raise TimeoutError("hang")

    signal.signal(signal.SIGALRM, alarm)
    for name, path in items:
        signal.alarm(FUZZ_TIMEOUT_S)
        try:
            got = _read_all(path)
            try:
                oracle = _gguf_py_tensors(Path(path))
                same = sorted(got) == sorted(oracle) and all(  # bitwise: a flipped type may decode to NaN
                    torch.equal(got[k].view(torch.int32), oracle[k].view(torch.int32)) for k in got)
            except Exception:  # noqa: BLE001 - gguf-py refusing what quantkit read is itself a failure
                same = False
            out[name] = {"status": "ok", "equal_to_gguf_py": same}
        except QuantkitError as exc:
            out[name] = {"status": "error", "message": str(exc)}
        except TimeoutError:
            out[name] = {"status": "hang"}
        except BaseException as exc:  # noqa: BLE001 - what the fuzz test is looking for
            out[name] = {"status": "crash", "message": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-1500:]}
        finally:
            signal.alarm(0)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - start_rss
    conn.send(json.dumps({"results": out, "rss_growth_mb": grown}))
    conn.close()
    os._exit(0)


def test_fuzzed_gguf_files_are_refused_with_one_line_or_read_correctly(tmp_path):
    base_path = tmp_path / "base.gguf"
    _fuzz_base(base_path)
    base = base_path.read_bytes()
    assert _read_all(str(base_path)).keys() == _gguf_py_tensors(base_path).keys()
    variants = []
    for i, (name, data) in enumerate(_mutations(base, base_path)):
        p = tmp_path / f"v{i}.gguf"
        p.write_bytes(data)
        variants.append((name, str(p)))
    assert len(variants) >= 200
    ctx = multiprocessing.get_context("fork")
    chunks = [variants[i::2] for i in range(2)]
    results, growth = {}, []
    procs = []
    for chunk in chunks:
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_fuzz_chunk, args=(chunk, child), daemon=True)
        p.start()
        child.close()
        procs.append((p, parent, chunk))
    for p, parent, chunk in procs:
        if parent.poll(FUZZ_TIMEOUT_S * len(chunk)):
            msg = json.loads(parent.recv())
            results.update(msg["results"])
            growth.append(msg["rss_growth_mb"])
        p.join(30)
        assert p.exitcode == 0, f"a fuzz child died (exit {p.exitcode}) in {[n for n, _ in chunk][:3]}..."
    assert len(results) == len(variants)
    bad = {k: v for k, v in results.items() if v["status"] not in ("ok", "error")}
    assert not bad, json.dumps(dict(list(bad.items())[:5]), indent=1)
    for name, r in results.items():
        if r["status"] == "error":
            assert "\n" not in r["message"] and r["message"], (name, r)
        else:  # read: it must be what gguf-py decodes from the same bytes
            assert r["equal_to_gguf_py"], name
    assert max(growth) < FUZZ_RSS_LIMIT_MB, growth
    counts = {s: sum(r["status"] == s for r in results.values()) for s in ("ok", "error")}
    print(f"\nfuzz: {len(variants)} variants: {counts}")
    shutil.rmtree(tmp_path, ignore_errors=True)
