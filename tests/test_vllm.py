"""The vLLM tier (pytest -m vllm): every layout quantkit writes, served by vLLM itself.

vLLM's CPU build lives in its own venv (scripts/setup_vllm_venv.sh -> .venv-vllm; its pins clash with
ours) and is driven through scripts/vllm_score.py in a subprocess, which imports no quantkit. For each
layout the demo model is quantized as a user would, vLLM loads the folder unmodified and returns its
top-20 prompt log-probs on held-out text, and quantkit's own loader (reference backend, float32)
scores the same tokens. Layouts the support matrix (quantkit.formats.loaders) says vLLM refuses are
checked to be refused, so the matrix cannot drift from what vLLM does.

KL is measured on the coarsened distributions (vLLM's top-20 tokens plus one bucket for the rest):
a lower bound of the full KL that loses little when 20 tokens hold most of the mass.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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
# vLLM's bfloat16 activations are the whole difference there. W8A8 adds vLLM's own int8 rounding of
# bfloat16 activations (quantkit rounds float32 ones), so a rounding flip in one layer feeds the next:
#   ct-w8a8 (SmoothQuant): top-1 0.916, KL 0.0119 (the demo's first 4 layers alone: 0.931, 0.0051)
# What the thresholds can tell apart (measured the same way): vLLM's gptq default against the
# unquantized model, i.e. the whole 4-bit error, top-1 0.741, KL 0.196; vLLM's awq zero-point folder
# against quantkit's symmetric one (other 4-bit codes of the same weights), top-1 0.670, KL 0.230.
# A layout vLLM decoded differently from quantkit would differ at least that much.
MIN_TOP1, MAX_KL = 0.92, 0.005  # weight-only: ~1.5 points of top-1 and 4x the KL below the worst measured
W8A8_MIN_TOP1, W8A8_MAX_KL = 0.85, 0.03


@dataclass
class Layout:
    name: str
    quantize: dict = field(default_factory=dict)  # quantkit.quantize keyword arguments
    cli: list[str] | None = None  # or a `quantkit quantize` command line, as a user types it
    dtype: str = "bfloat16"  # vLLM's dtype for the folder
    w8a8: bool = False  # int8 activations: W8A8 thresholds


LAYOUTS = [
    # the user's own command: GPTQ 4-bit, act-order with static groups
    Layout("gptq-default", cli=["--method", "gptq", "--bits", "4"]),
    Layout("gptq-dynamic-act-order", cli=["--method", "gptq", "--bits", "4", "--no-static-groups"]),
    # the other flags change the stored scheme only, which RTN writes in the same layout, faster
    # (--no-desc-act: RTN's trivial g_idx and desc_act false; AWQ's scales are folded into the
    # weights before packing: its layout is the RTN one's)
    Layout("gptq-no-act-order", cli=["--method", "rtn", "--option", "mse=false", "--bits", "4", "--format", "gptq"]),
    Layout("gptq-w8", cli=["--method", "rtn", "--option", "mse=false", "--bits", "8", "--format", "gptq"]),
    Layout("gptq-w4-per-channel", cli=["--method", "rtn", "--option", "mse=false", "--bits", "4", "--group-size", "-1", "--format", "gptq"]),
    Layout("gptq-asym", cli=["--method", "rtn", "--option", "mse=false", "--bits", "4", "--asym", "--format", "gptq"]),
    Layout("gptq-w3", cli=["--method", "rtn", "--option", "mse=false", "--bits", "3", "--format", "gptq", "--group-size", "32"]),
    Layout("awq-zero-point", cli=["--method", "rtn", "--option", "mse=false", "--bits", "4", "--asym", "--format", "awq"]),
    Layout("awq-sym", cli=["--method", "rtn", "--option", "mse=false", "--bits", "4", "--sym", "--format", "awq"]),
    Layout("ct-w4a16", cli=["--method", "gptq", "--bits", "4", "--format", "compressed-tensors"]),
    Layout("ct-w4a16-asym", cli=["--method", "rtn", "--option", "mse=false", "--bits", "4", "--asym", "--format", "compressed-tensors"]),
    Layout("ct-w8a16", cli=["--method", "rtn", "--option", "mse=false", "--bits", "8", "--format", "compressed-tensors"]),
    Layout("ct-w8a8", cli=["--method", "smoothquant"], w8a8=True),
]


def _vllm_venv_or_skip() -> Path:
    if VLLM_PYTHON.is_file():
        return VLLM_PYTHON
    why = f"no vLLM venv at {VLLM_PYTHON.parent.parent}: run scripts/setup_vllm_venv.sh"
    if os.environ.get("QUANTKIT_REQUIRE_VLLM") == "1":  # CI builds it: its absence is a failure there
        pytest.fail(why)
    pytest.skip(why)


def _quantize(layout: Layout, out: Path) -> None:
    if layout.cli is not None:
        calibration = [] if "rtn" in layout.cli else ["--num-samples", str(CALIBRATION["num_samples"]),
                                                       "--seq-len", str(CALIBRATION["seq_len"])]
        cmd = [sys.executable, "-m", "quantkit", "quantize", *layout.cli, *calibration, "--output", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr[-3000:]}"
    else:
        import quantkit

        quantkit.quantize("demo", output=out, progress=False, **CALIBRATION, **layout.quantize)


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
    folders = {"unquantized": base}
    for layout in LAYOUTS:
        folders[layout.name] = where / layout.name
        if not (kept and (folders[layout.name] / "config.json").is_file()):
            _quantize(layout, folders[layout.name])
    dtypes = {layout.name: layout.dtype for layout in LAYOUTS}
    models = [{"name": "unquantized", "path": str(base), "dtype": "bfloat16"},
              {"name": "unquantized-fp32", "path": str(base), "dtype": "float32"}]
    models += [{"name": n, "path": str(folders[n]), "dtype": dtypes[n]} for n in dtypes]
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
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    reference["unquantized"] = reference["unquantized-fp32"] = _reference_log_probs(hf, windows)
    del hf
    for layout in LAYOUTS:
        if vllm[layout.name]["ok"]:
            model = quantkit.load(folders[layout.name], backend="reference", dtype="float32")
            reference[layout.name] = _reference_log_probs(model, windows)
            del model
    results = {}
    for name, r in vllm.items():
        # compare's "positions" (a count) replaces vLLM's per-position lists
        results[name] = dict(r, **compare(reference[name], r["positions"])) if r["ok"] else r
    print("\nvLLM tier (vLLM bf16 vs quantkit reference fp32):")
    for name, r in results.items():
        print(f"  {name:24s} " + (f"top1 {r['top1']:.4f}  KL {r['kl']:.5f}  ({r['positions']} positions, "
                                  f"{r['seconds']:.0f} s in vLLM)" if r["ok"] else f"refused: {r['error']}"))
    return {"results": results, "folders": folders}


def _checkpoint(folder: Path):
    """(format, [LinearSpec]) of a written checkpoint, read back by `quantkit inspect`."""
    from quantkit.inspect import inspect_checkpoint
    from quantkit.qtensor import LinearSpec

    info = inspect_checkpoint(str(folder))
    specs = [LinearSpec(*layer["shape"], layer["bits"], layer["group_size"], layer["sym"], layer["act_order"],
                        layer.get("input_quant")) for layer in info["layers"].values()]
    return info["format"], specs


def test_unquantized_model_sets_the_spread(scored):
    """The threshold's footing: identical weights, vLLM's numerics alone."""
    base = scored["results"]["unquantized"]
    assert base["ok"] and base["positions"] >= 512
    assert base["top1"] >= MIN_TOP1 and base["kl"] <= MAX_KL, base
    fp32 = scored["results"]["unquantized-fp32"]
    assert fp32["ok"] and fp32["top1"] >= 0.99 and fp32["kl"] <= 1e-3, fp32


def test_default_gptq_checkpoint_loads_in_vllm(scored):
    """`quantkit quantize --method gptq --bits 4`: the checkpoint a user gets by default is served."""
    cfg = json.loads((scored["folders"]["gptq-default"] / "config.json").read_text())["quantization_config"]
    assert cfg["desc_act"] is False and cfg["act_order"] == "static"
    r = scored["results"]["gptq-default"]
    assert r["ok"], r
    assert r["top1"] >= MIN_TOP1 and r["kl"] <= MAX_KL, r


@pytest.mark.parametrize("name", [layout.name for layout in LAYOUTS])
def test_layout_in_vllm_matches_support_matrix(scored, name):
    """Served layouts agree with quantkit's loader; refused ones are refused, as the matrix says."""
    from quantkit.formats import loaders

    refusal = loaders.vllm_refusal(*_checkpoint(scored["folders"][name]))
    r = scored["results"][name]
    if refusal is None:
        assert r["ok"], f"the support matrix says vLLM serves {name}, but: {r.get('error')}"
        assert r["positions"] >= 512
        w8a8 = next(layout.w8a8 for layout in LAYOUTS if layout.name == name)
        min_top1, max_kl = (W8A8_MIN_TOP1, W8A8_MAX_KL) if w8a8 else (MIN_TOP1, MAX_KL)
        assert r["top1"] >= min_top1 and r["kl"] <= max_kl, r
    else:
        assert not r["ok"], f"vLLM now serves {name} (top1 {r['top1']:.3f}, KL {r['kl']:.4f}); " \
                            f"the support matrix says it refuses it: {refusal}"
        for quoted in re.findall(r'"([^"]+)"', refusal):  # the matrix quotes vLLM's own words
            assert quoted in r["error"], (quoted, r["error"])
