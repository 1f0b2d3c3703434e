"""The vLLM tier (pytest -m vllm): every layout quantkit writes, served by vLLM itself.

vLLM's CPU build lives in its own venv (scripts/setup_vllm_venv.sh -> .venv-vllm; its pins clash with
ours) and is driven through scripts/vllm_score.py in a subprocess, which imports no quantkit. For each
layout the demo model is quantized as a user would, vLLM loads the folder unmodified and returns its
top-20 prompt log-probs on held-out text, and quantkit's own loader (reference backend, float32)
scores the same tokens. Layouts the support matrix (quantkit.formats.loaders) says vLLM refuses are
checked to be refused, so the matrix cannot drift from what vLLM does. Besides the demo's layouts: a
gptq and a compressed-tensors mixture (vLLM's fused q/k/v and gate/up, quantkit.formats.fused_linears),
the compressed-tensors float presets (quantkit.float_checkpoint) and MoE experts on a tiny random
Qwen3-MoE (refused by vLLM's CPU build without Intel AMX).

KL is measured on the coarsened distributions (vLLM's top-20 tokens plus one bucket for the rest):
a lower bound of the full KL that loses little when 20 tokens hold most of the mass.

Time (the tier is CI's longest stage): the folders are written by `quantkit quantize` command lines run in
this process (the same argv through the same click entry point, without a fresh interpreter and model
import per layout), vLLM starts once for every folder (scripts/vllm_score.py), and only the user's default
command keeps GPTQ's range search (mse): the other GPTQ layouts test where act-order puts g_idx and how
compressed-tensors stores it, which the scales' choice does not change. The fixture prints each folder's
quantize, vLLM and reference seconds.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SCORER = ROOT / "scripts" / "vllm_score.py"
WINDOWS, WINDOW_LEN = 5, 129  # 5 x 128 = 640 scored positions (the issue asks for at least 512)
TOP_K = 20
CALIBRATION = dict(num_samples=8, seq_len=128)  # small: the tier checks layouts, not quality

# Thresholds, from the spread vLLM shows where the weights are identical (measured here on 2 busy cores,
# vLLM 0.32 CPU in bfloat16 against quantkit's reference loader in float32, 640 held-out positions):
#   the unquantized demo model, vLLM bfloat16:  top-1 agreement 0.975, coarse KL 0.0008
#   the unquantized demo model, vLLM float32:   top-1 agreement 1.000, coarse KL 3e-11
#   weight-only layouts (gptq default / per channel / no act-order, awq sym / zero point, ct w4a16 asym):
#                                               top-1 0.956-0.973, KL 0.0011-0.0012
#   llm-compressor's own gptq w4g64 checkpoint (scripts/vllm_llmcompressor_spread.py, not in CI):
#                                               top-1 0.964, KL 0.0012 against transformers and quantkit alike
#   a gptq mixture (q/k/v at g32, gate/up per channel, down g128, rest g64):  top-1 0.969, KL 0.0011
# vLLM's bfloat16 activations are the whole difference there. W8A8 adds vLLM's own int8 rounding of
# bfloat16 activations (quantkit rounds float32 ones), so a rounding flip in one layer feeds the next:
#   ct-w8a8 (SmoothQuant): top-1 0.916, KL 0.0119 (the demo's first 4 layers alone: 0.931, 0.0051)
#   ct-fp8-dynamic (fp8 weights and dynamic per-token fp8 activations, the same mechanism): 0.903, 0.0157
# What the thresholds can tell apart (measured the same way): vLLM's gptq default against the
# unquantized model, i.e. the whole 4-bit error, top-1 0.741, KL 0.196; vLLM's awq zero-point folder
# against quantkit's symmetric one (other 4-bit codes of the same weights), top-1 0.670, KL 0.230.
# A layout vLLM decoded differently from quantkit would differ at least that much.
MIN_TOP1, MAX_KL = 0.92, 0.005  # weight-only: ~1.5 points of top-1 and 4x the KL below the worst measured
W8A8_MIN_TOP1, W8A8_MAX_KL = 0.85, 0.03
# (base model, quantized activations) -> (min top-1, max KL). The tiny random MoE's next-token distributions
# are nearly flat (vLLM bf16 on it: top-1 0.981, KL 1.5e-8), so its KL bound cannot tell much apart and
# its top-1 bound is the weight-only one; no quantized MoE is served by vLLM's CPU build on a CPU
# without AMX (tests below), so these were not exercised on a served MoE here.
THRESHOLDS = {("demo", False): (MIN_TOP1, MAX_KL), ("demo", True): (W8A8_MIN_TOP1, W8A8_MAX_KL),
              ("moe", False): (MIN_TOP1, MAX_KL), ("moe", True): (W8A8_MIN_TOP1, W8A8_MAX_KL)}


@dataclass
class Layout:
    name: str
    quantize: dict = field(default_factory=dict)  # quantkit.quantize keyword arguments
    cli: list[str] | None = None  # or a `quantkit quantize` command line, as a user types it
    dtype: str = "bfloat16"  # vLLM's dtype for the folder
    w8a8: bool = False  # quantized activations (int8 W8A8, dynamic fp8): the W8A8 thresholds
    recipe: str | None = None  # YAML recipe text, passed as --recipe (per-module overrides)
    float_preset: str | None = None  # or a compressed-tensors float preset (quantkit.float_checkpoint.write)
    model: str = "demo"  # or "moe": the demo split into a Qwen2-MoE (scripts/moe_models.py moefied_qwen2_moe)


# A mixture as the allocator or a recipe writes it (per-module overrides, GPTQModel `dynamic` rules in
# gptq): vLLM fuses q/k/v and gate/up and looks rules up under the fused name, so a group is one rule
# (quantkit.formats.fused_linears). Group sizes vary, not bits: vLLM's CPU build has 4-bit kernels only.
MIXTURE = """method: rtn
scheme:
  bits: 4
  group_size: 64
  overrides:
    - {pattern: "layers\\\\.0\\\\.self_attn\\\\.(q|k|v)_proj$", group_size: 32}
    - {pattern: "layers\\\\.1\\\\.mlp\\\\.(gate|up)_proj$", group_size: -1}
    - {pattern: "layers\\\\.2\\\\.mlp\\\\.down_proj$", group_size: 128}
"""
# q_proj alone at another scheme: vLLM cannot serve it (one fused qkv_proj, one scheme)
SPLIT_GROUP = """method: rtn
scheme:
  bits: 4
  group_size: 64
  overrides:
    - {pattern: "layers\\\\.0\\\\.self_attn\\\\.q_proj$", group_size: 32}
"""


LAYOUTS = [
    # the user's own command: GPTQ 4-bit, act-order with static groups
    Layout("gptq-default", cli=["--method", "gptq", "--bits", "4"]),
    # layouts, not quality: GPTQ without the range search (mse) writes the same g_idx and tensors; its solve on
    # the demo's layer shapes 4.4-5.8x (static groups) and 1.6-2.2x (dynamic) faster on 2 busy cores
    # (scripts/bench_gptq_range_search.py)
    Layout("gptq-dynamic-act-order", cli=["--method", "gptq", "--bits", "4", "--no-static-groups", "--option", "mse=false"]),
    # the other flags change the stored scheme only, which RTN writes in the same layout, faster
    # (--no-desc-act: RTN's trivial g_idx and desc_act false; AWQ's scales are folded into the
    # weights before packing: its layout is the RTN one's)
    Layout("gptq-no-act-order", cli=["--method", "rtn", "--option", "mse=false", "--bits", "4", "--format", "gptq"]),
    Layout("gptq-w8", cli=["--method", "rtn", "--option", "mse=false", "--bits", "8", "--format", "gptq"]),
    Layout("gptq-w4-per-channel", cli=["--method", "rtn", "--option", "mse=false", "--bits", "4", "--group-size", "-1", "--format", "gptq"]),
    Layout("gptq-asym", cli=["--method", "rtn", "--option", "mse=false", "--bits", "4", "--asym", "--format", "gptq"]),
    # auto-round's full-range symmetric grid: negative fp16 scales where a group's positive extreme dominates,
    # the zero 8 implied (vLLM's uint4b8); compressed-tensors' wNa16 reads it the same (checked by hand, #48)
    Layout("gptq-full-range", cli=["--method", "rtn", "--option", "mse=false", "--option", "sym_range=full",
                                   "--bits", "4", "--format", "gptq"]),
    Layout("gptq-w3", cli=["--method", "rtn", "--option", "mse=false", "--bits", "3", "--format", "gptq", "--group-size", "32"]),
    Layout("awq-zero-point", cli=["--method", "rtn", "--option", "mse=false", "--bits", "4", "--asym", "--format", "awq"]),
    Layout("awq-sym", cli=["--method", "rtn", "--option", "mse=false", "--bits", "4", "--sym", "--format", "awq"]),
    Layout("ct-w4a16", cli=["--method", "gptq", "--bits", "4", "--option", "mse=false", "--format", "compressed-tensors"]),
    Layout("ct-w4a16-asym", cli=["--method", "rtn", "--option", "mse=false", "--bits", "4", "--asym", "--format", "compressed-tensors"]),
    Layout("ct-w8a16", cli=["--method", "rtn", "--option", "mse=false", "--bits", "8", "--format", "compressed-tensors"]),
    Layout("ct-w8a8", cli=["--method", "smoothquant"], w8a8=True),
    Layout("gptq-mixture", cli=["--method", "rtn", "--option", "mse=false", "--format", "gptq"], recipe=MIXTURE),
    Layout("gptq-mixture-split-qkv", cli=["--method", "rtn", "--option", "mse=false", "--format", "gptq"],
           recipe=SPLIT_GROUP),
    Layout("ct-mixture", cli=["--method", "rtn", "--option", "mse=false", "--format", "compressed-tensors"],
           recipe=MIXTURE),
    # compressed-tensors float presets (#47), written by quantkit.float_checkpoint.write (RTN)
    Layout("ct-fp8-dynamic", float_preset="FP8_DYNAMIC", w8a8=True),  # fp8 weights, dynamic fp8 activations
    # FP8_BLOCK is not here: its activations go in groups of 128, which the tier's models' 576-wide inputs do not
    # divide, so quantkit's writer refuses it (tests/test_float_checkpoint.py); vLLM's CPU build refused it too
    # (2026-12-05: "Weight output_partition_size = 576 is not divisible by weight quantization block_n = 128")
    Layout("ct-nvfp4a16", float_preset="NVFP4A16"),
    Layout("ct-mxfp8a16", float_preset="MXFP8A16"),
    Layout("ct-mxfp8", float_preset="MXFP8", w8a8=True),
    Layout("ct-mxfp4a16", float_preset="MXFP4A16"),
    Layout("ct-mxfp4", float_preset="MXFP4", w8a8=True),
    # MoE experts (per-expert tensors), on a tiny random Qwen3-MoE
    Layout("moe-gptq", model="moe", cli=["--method", "rtn", "--option", "mse=false", "--group-size", "64",
                                         "--sym", "--format", "gptq"]),
    Layout("moe-awq", model="moe", cli=["--method", "rtn", "--option", "mse=false", "--group-size", "64",
                                        "--asym", "--format", "awq"]),
    Layout("moe-ct-w4a16", model="moe", cli=["--method", "rtn", "--option", "mse=false", "--group-size", "64",
                                             "--sym", "--format", "compressed-tensors"]),
]


UNQUANTIZED = {"demo": "unquantized", "moe": "moe-unquantized"}  # the spread's rows, per base model


def _moe_model(folder: Path, dense: Path) -> Path:
    """A tiny random Qwen3-MoE (2 layers, 4 experts, top-2) saved with the demo tokenizer, built once
    per checkpoint dir. (The demo split into a Qwen2-MoE, scripts/moe_models.py moefied_qwen2_moe, would
    give peaked distributions, but vLLM 0.32's CPU build returns NaN log-probs for it, unquantized.)"""
    if (folder / "config.json").is_file():
        return folder
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from moe_models import random_qwen3_moe
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return random_qwen3_moe(folder, tokenizer_from=dense, layers=2, experts=4, hidden=256, moe_intermediate=128,
                            heads=4, kv_heads=2)


def _cpu_has_amx() -> bool:
    """Intel AMX, which vLLM's CPU expert kernels need (the kernel's own check; read from /proc/cpuinfo)."""
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _vllm_venv_or_skip() -> Path:
    if VLLM_PYTHON.is_file():
        return VLLM_PYTHON
    why = f"no vLLM venv at {VLLM_PYTHON.parent.parent}: run scripts/setup_vllm_venv.sh"
    if os.environ.get("QUANTKIT_REQUIRE_VLLM") == "1":  # CI builds it: its absence is a failure there
        pytest.fail(why)
    pytest.skip(why)


def _quantize(layout: Layout, out: Path, bases: dict[str, Path]) -> None:
    if layout.float_preset is not None:  # the writer `--scheme` runs, called directly on a bf16 model (as vLLM serves it)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from quantkit.float_checkpoint import write
        from quantkit.scheme_presets import preset

        model = AutoModelForCausalLM.from_pretrained(bases[layout.model], dtype=torch.bfloat16)
        write(model, preset(layout.float_preset), out)
        AutoTokenizer.from_pretrained(bases[layout.model]).save_pretrained(out)
    elif layout.cli is not None:
        calibration = [] if "rtn" in layout.cli else ["--num-samples", str(CALIBRATION["num_samples"]),
                                                       "--seq-len", str(CALIBRATION["seq_len"])]
        recipe = []
        if layout.recipe is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            (out.parent / f"{layout.name}.yaml").write_text(layout.recipe)
            recipe = ["--recipe", str(out.parent / f"{layout.name}.yaml")]
        from quantkit.cli import cli

        argv = ["quantize", "--model", str(bases[layout.model]), *recipe, *layout.cli, *calibration, "--output", str(out)]
        # `quantkit <argv>` in this process: a user error raises here (standalone_mode=False), naming itself
        cli.main(args=argv, standalone_mode=False, prog_name="quantkit")
        assert (out / "config.json").is_file(), f"quantkit {' '.join(argv)} wrote no checkpoint"
    else:
        import quantkit

        quantkit.quantize(str(bases[layout.model]), output=out, progress=False, **CALIBRATION, **layout.quantize)


def _held_out_windows(tokenizer) -> list[list[int]]:
    from quantkit import data

    stream = data.eval_token_stream("wiki", tokenizer, max_tokens=WINDOWS * WINDOW_LEN)
    assert stream.numel() == WINDOWS * WINDOW_LEN
    return stream.view(WINDOWS, WINDOW_LEN).tolist()


def _reference_log_probs(model, windows) -> torch.Tensor:
    """[positions, vocab] float32 log-probs of the next token, every position after each window's first."""
    with torch.no_grad():
        logits = model(torch.tensor(windows)).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).reshape(-1, logits.shape[-1])


def compare(reference: torch.Tensor, served: list) -> dict:
    """Top-1 agreement and mean coarse KL(reference || vLLM) over the positions.

    `served` is vLLM's [[top ids], [top log-probs]] per position; both distributions are coarsened onto
    vLLM's top-k tokens plus one bucket for the rest, so the KL needs no full vLLM vocabulary."""
    assert len(served) == reference.shape[0], (len(served), reference.shape)
    ids = torch.tensor([p[0] for p in served])
    lv = torch.tensor([p[1] for p in served], dtype=torch.float64)
    lq = reference.double().gather(1, ids)
    rest_v = (1 - lv.exp().sum(1)).clamp_min(1e-12)
    rest_q = (1 - lq.exp().sum(1)).clamp_min(1e-12)
    kl = (lq.exp() * (lq - lv)).sum(1) + rest_q * (rest_q.log() - rest_v.log())
    top1 = (ids[:, 0] == reference.argmax(1)).double()
    return {"top1": top1.mean().item(), "kl": kl.mean().item(), "positions": len(served)}


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """Quantize every layout, score them all (and the unquantized model) in one vLLM process."""
    python = _vllm_venv_or_skip()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.assets import demo_model_dir

    base = Path(demo_model_dir())
    tok = AutoTokenizer.from_pretrained(base)
    windows = _held_out_windows(tok)
    tmp = tmp_path_factory.mktemp("vllm")
    # QUANTKIT_VLLM_CHECKPOINTS=DIR keeps the quantized folders there and reuses finished ones (local reruns)
    kept = os.environ.get("QUANTKIT_VLLM_CHECKPOINTS")
    where = Path(kept) if kept else tmp
    bases = {"demo": base}
    if any(layout.model == "moe" for layout in LAYOUTS):
        bases["moe"] = _moe_model(where / "moe-model", base)
    folders = {UNQUANTIZED[m]: bases[m] for m in bases}
    seconds = {}  # per folder: quantize and reference seconds (vLLM's come back in its scores)
    for layout in LAYOUTS:
        folders[layout.name] = where / layout.name
        if not (kept and (folders[layout.name] / "config.json").is_file()):
            t0 = time.perf_counter()
            _quantize(layout, folders[layout.name], bases)
            seconds[layout.name] = {"quantize": time.perf_counter() - t0}
    models = []
    # per base model, its spread (unquantized in bfloat16 and float32) then its layouts; MoE first: in one
    # process, vLLM 0.32 loses its expert-parallel group for a quantized MoE loaded after dense models
    # ("expert parallel group is not initialized")
    for m in sorted(bases, key=lambda m: m != "moe"):
        models += [{"name": UNQUANTIZED[m], "path": str(bases[m]), "dtype": "bfloat16"},
                   {"name": f"{UNQUANTIZED[m]}-fp32", "path": str(bases[m]), "dtype": "float32"}]
        models += [{"name": layout.name, "path": str(folders[layout.name]), "dtype": layout.dtype}
                   for layout in LAYOUTS if layout.model == m]
    tmp = where  # the request and vLLM's scores are kept with the folders too
    request = tmp / "request.json"
    request.write_text(json.dumps({"windows": windows, "top_k": TOP_K, "models": models}))
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1))
    done = subprocess.run([str(python), str(SCORER), str(request), str(tmp / "scores.json")],
                          capture_output=True, text=True, env=env, cwd=tmp)
    assert done.returncode == 0, done.stderr[-5000:]
    vllm = json.loads((tmp / "scores.json").read_text())

    import quantkit

    reference = {}
    shapes = {}
    for m in bases:  # transformers in float32 on the unquantized folder
        hf = AutoModelForCausalLM.from_pretrained(bases[m], dtype=torch.float32).eval()
        reference[UNQUANTIZED[m]] = reference[f"{UNQUANTIZED[m]}-fp32"] = _reference_log_probs(hf, windows)
        shapes[m] = {n: (mod.out_features, mod.in_features) for n, mod in hf.named_modules()
                     if isinstance(mod, torch.nn.Linear) and n != "lm_head"}
        del hf
    for layout in LAYOUTS:
        if vllm[layout.name]["ok"]:
            t0 = time.perf_counter()
            model = quantkit.load(folders[layout.name], backend="reference", dtype="float32")
            reference[layout.name] = _reference_log_probs(model, windows)
            del model
            seconds.setdefault(layout.name, {})["reference"] = time.perf_counter() - t0
    results = {}
    for name, r in vllm.items():
        # compare's "positions" (a count) replaces vLLM's per-position lists
        results[name] = dict(r, **compare(reference[name], r["positions"])) if r["ok"] else r
    print("\nvLLM tier (vLLM bf16 vs quantkit reference fp32):")
    for name, r in results.items():
        took = "".join(f", {s:.0f} s {what}" for what, s in seconds.get(name, {}).items())
        print(f"  {name:24s} " + (f"top1 {r['top1']:.4f}  KL {r['kl']:.5f}  ({r['positions']} positions, "
                                  f"{r['seconds']:.0f} s in vLLM{took})" if r["ok"] else f"refused: {r['error']}"
                                  f"{' (' + took[2:] + ')' if took else ''}"))
    return {"results": results, "folders": folders, "shapes": shapes}


def _checkpoint(folder: Path):
    """(format, {module name: LinearSpec}) of a written checkpoint, read back by `quantkit inspect`."""
    from quantkit.inspect import inspect_checkpoint
    from quantkit.qtensor import LinearSpec

    info = inspect_checkpoint(str(folder))
    specs = {name: LinearSpec(*layer["shape"], layer["bits"], layer["group_size"], layer["sym"], layer["act_order"],
                              layer.get("input_quant")) for name, layer in info["layers"].items()}
    return info["format"], specs


def test_unquantized_model_sets_the_spread(scored):
    """The threshold's footing: identical weights, vLLM's numerics alone."""
    for m, name in UNQUANTIZED.items():
        if m not in scored["shapes"]:
            continue
        min_top1, max_kl = THRESHOLDS[(m, False)]
        base = scored["results"][name]
        assert base["ok"] and base["positions"] >= 512
        assert base["top1"] >= min_top1 and base["kl"] <= max_kl, base
        fp32 = scored["results"][f"{name}-fp32"]
        assert fp32["ok"] and fp32["top1"] >= 0.99 and fp32["kl"] <= 1e-3, fp32


def test_default_gptq_checkpoint_loads_in_vllm(scored):
    """`quantkit quantize --method gptq --bits 4`: the checkpoint a user gets by default is served."""
    cfg = json.loads((scored["folders"]["gptq-default"] / "config.json").read_text())["quantization_config"]
    assert cfg["desc_act"] is False and cfg["act_order"] == "static"
    r = scored["results"]["gptq-default"]
    assert r["ok"], r
    assert r["top1"] >= MIN_TOP1 and r["kl"] <= MAX_KL, r


def test_gptq_mixture_is_one_rule_per_fused_group(scored):
    """The mixture's q/k/v and gate/up overrides reach vLLM's fused layers (its lookup: re.match of the
    rule on the fused name), so what vLLM scores below is the mixture, not the base scheme."""
    dynamic = json.loads((scored["folders"]["gptq-mixture"] / "config.json").read_text())["quantization_config"]["dynamic"]
    fused = {name: next((o for p, o in dynamic.items() if re.match(p.removeprefix("+:"), name)), None)
             for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj",
                          "model.layers.2.mlp.down_proj", "model.layers.3.self_attn.qkv_proj")}
    assert [o and o["group_size"] for o in fused.values()] == [32, -1, 128, None], dynamic


@pytest.mark.parametrize("name", [layout.name for layout in LAYOUTS])
def test_layout_in_vllm_matches_support_matrix(scored, name):
    """Served layouts agree with quantkit's loader; refused ones are refused, as the matrix says."""
    from quantkit.formats import loaders

    layout = next(layout for layout in LAYOUTS if layout.name == name)
    if layout.float_preset is not None:
        refusal = loaders.vllm_float_refusal(layout.float_preset, scored["shapes"][layout.model])
    elif layout.model == "moe":
        refusal = (loaders.vllm_cpu_moe_refusal(layout.cli[layout.cli.index("--format") + 1], _cpu_has_amx())
                   or loaders.vllm_refusal(*_checkpoint(scored["folders"][name])))
    else:
        refusal = loaders.vllm_refusal(*_checkpoint(scored["folders"][name]))
    r = scored["results"][name]
    if refusal is None:
        assert r["ok"], f"the support matrix says vLLM serves {name}, but: {r.get('error')}"
        assert r["positions"] >= 512
        min_top1, max_kl = THRESHOLDS[(layout.model, layout.w8a8)]
        assert r["top1"] >= min_top1 and r["kl"] <= max_kl, r
    else:
        assert not r["ok"], f"vLLM now serves {name} (top1 {r['top1']:.3f}, KL {r['kl']:.4f}); " \
                            f"the support matrix says it refuses it: {refusal}"
        for quoted in re.findall(r'"([^"]+)"', refusal):  # the matrix quotes vLLM's own words
            assert quoted in r["error"], (quoted, r["error"])
