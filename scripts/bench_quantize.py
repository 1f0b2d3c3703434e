#!/usr/bin/env python
"""Quantization wall time, peak RSS and held-out perplexity, side by side, from one run.

Each quantize runs in its own subprocess (so peak RSS is that run's alone) through the real CLI,
then every checkpoint is scored by `quantkit eval` on the same held-out Lee tokens. With
--llmcompressor-python PATH (a separate venv where llm-compressor is installed) the same model and
scheme also go through llm-compressor (scripts/llmcompressor_peer.py: GPTQModifier, AWQModifier,
QuantizationModifier for rtn, SmoothQuantModifier + W8A8 for smoothquant) and the script prints
quantkit / llm-compressor ratios. Both tools calibrate on exactly the same tokens: they are drawn
once with quantkit's own pipeline (data.calibration_batches, as `quantkit quantize` does) and
handed to the peer as WORKDIR/calib_ids.safetensors. llm-compressor is a benchmark peer only.

"quantize s" is load + calibrate + write inside the process for both tools; the peer's oneshot()
call alone is printed separately. "process cpu s" is the child's user + sys CPU time: on a shared
machine wall time swings several-fold with other load, CPU time much less.

    python scripts/bench_quantize.py --methods rtn,gptq --num-samples 64 --seq-len 512
    python scripts/bench_quantize.py --methods gptq,awq --llmcompressor-python /work/peer-venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(cmd: list[str], env=None, cwd=None) -> tuple[dict, float]:
    """Run one child (in `cwd` if given); returns its last-line JSON and its wall seconds. The child's
    CPU seconds (user + sys, which a busy machine inflates far less than wall time) go into the JSON as
    _cpu_s."""
    t0, c0 = time.perf_counter(), _children_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["_cpu_s"] = round(_children_cpu() - c0, 1)
    return result, wall


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def quantkit_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "quantkit.cli", *args]


PEER_METHODS = ("gptq", "awq", "rtn", "smoothquant")  # variants llmcompressor_peer.py runs, same names


def write_calibration_ids(model: str, num_samples: int, seq_len: int, path: Path) -> str:
    """The exact calibration tokens `quantkit quantize` draws (default dataset and seed, same
    tokenizer), saved for the peer; returns the model folder the peer should load."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from quantkit import data
    from quantkit.plan import CALIBRATION_DEFAULTS as DEFAULTS
    from quantkit.sources import resolve_model_path

    folder = resolve_model_path(model)  # 'demo' -> quantkit.assets.demo_model_dir()
    if not Path(folder).is_dir():
        sys.exit(f"--llmcompressor-python needs --model to be 'demo' or a local HF folder, not {model}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = data.calibration_batches(DEFAULTS["dataset"], tokenizer, num_samples=num_samples, seq_len=seq_len,
                                   seed=DEFAULTS["seed"])
    save_file({"input_ids": ids.to(torch.int64).contiguous()}, str(path))
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--methods", default="rtn,gptq",
                    help="comma list of variants (rtn, gptq, gptq-staged, gptq-actorder, awq, awq-noclip, smoothquant); "
                         "smoothquant is always W8A8 (int8 per-channel weights, dynamic per-token int8 inputs)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", default="64")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=None, help="eval windows (default: all held-out text)")
    ap.add_argument("--llmcompressor-python", default=None, help="python of a venv with llm-compressor installed")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="qk-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    # name -> (quantkit method, extra flags, takes --bits/--group-size)
    variants = {"rtn": ("rtn", [], True), "gptq": ("gptq", [], True),
                # the stage-by-stage driver (a pass per stage + one), as any run with several batches uses
                "gptq-staged": ("gptq", ["--batch-size", "8"], True),
                "gptq-actorder": ("gptq", ["--option", "desc_act=true"], True),
                "awq": ("awq", ["--format", "gptq"], True),
                "awq-noclip": ("awq", ["--format", "gptq", "--option", "clip=false"], True),
                "smoothquant": ("smoothquant", [], False)}
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    unknown = [n for n in names if n not in variants]
    if unknown:
        sys.exit(f"unknown variant(s) {unknown}; choose from {', '.join(variants)}")

    def tag(name: str) -> str:
        return "w8a8" if not variants[name][2] else f"w{args.bits}g{args.group_size}"

    peer_folder = calib_ids = None
    if args.llmcompressor_python:
        calib_ids = work / "calib_ids.safetensors"
        peer_folder = write_calibration_ids(args.model, args.num_samples, args.seq_len, calib_ids)
    for name in names:
        method, extra, takes_scheme = variants[name]
        out = work / f"{name}-{tag(name)}"
        scheme = ["--bits", str(args.bits), "--group-size", args.group_size] if takes_scheme else []
        summary, wall = run(quantkit_cli("quantize", "--model", args.model, "--method", method, *scheme,
                                         "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
                                         "--output", str(out), "--overwrite", "--json", *extra))
        rows.append({"tool": "quantkit", "variant": name, "path": str(out), "quantize_s": summary["seconds"],
                     "process_s": round(wall, 1), "process_cpu_s": summary["_cpu_s"], "peak_rss_mb": summary["peak_rss_mb"]})
    peer_version = None
    if args.llmcompressor_python:
        for name in names:
            if name not in PEER_METHODS:
                continue
            out = work / f"llmc-{name}-{tag(name)}"
            summary, wall = run([args.llmcompressor_python, str(HERE / "llmcompressor_peer.py"), "--method", name,
                                 "--model", peer_folder, "--bits", str(args.bits), "--group-size", args.group_size,
                                 "--calib-ids", str(calib_ids), "--output", str(out)])
            peer_version = summary.get("llmcompressor_version")
            rows.append({"tool": "llm-compressor", "variant": name, "path": str(out),
                         "quantize_s": summary.get("total_seconds", summary["seconds"]), "oneshot_s": summary["seconds"],
                         "process_s": round(wall, 1), "process_cpu_s": summary["_cpu_s"],
                         "peak_rss_mb": summary["peak_rss_mb"]})
    eval_args = ["--json"] + (["--max-windows", str(args.max_windows)] if args.max_windows else [])
    base, _ = run(quantkit_cli("eval", "--model", args.model, *eval_args))
    for row in rows:
        r, _ = run(quantkit_cli("eval", "--model", row["path"], "--backend", "reference", *eval_args))
        row["perplexity"] = round(r["perplexity"], 4)
        row["ppl_ratio_vs_original"] = round(r["perplexity"] / base["perplexity"], 4)
    print(f"original perplexity {base['perplexity']:.4f} over {base['tokens']} held-out tokens ({base['windows']} windows)")
    print(f"calibration: {args.num_samples} x {args.seq_len} tokens" +
          (f"; llm-compressor {peer_version}" if peer_version else ""))
    print(f"{'tool':15} {'variant':14} {'quantize s':>10} {'process s':>9} {'process cpu s':>13} {'peak RSS MB':>11} "
          f"{'ppl':>9} {'ppl/orig':>8}")
    for r in rows:
        print(f"{r['tool']:15} {r['variant']:14} {r['quantize_s']:10.1f} {r['process_s']:9.1f} {r['process_cpu_s']:13.1f} "
              f"{r['peak_rss_mb']:11.0f} {r['perplexity']:9.4f} {r['ppl_ratio_vs_original']:8.4f}")
    for r in rows:
        if "oneshot_s" in r:
            print(f"llm-compressor {r['variant']}: oneshot() alone {r['oneshot_s']:.1f} s")
    peers = {(r["variant"]): r for r in rows if r["tool"] == "llm-compressor"}
    for r in rows:
        p = peers.get(r["variant"])
        if r["tool"] == "quantkit" and p:
            print(f"quantkit/llm-compressor {r['variant']}: time {r['quantize_s'] / p['quantize_s']:.2f}x, "
                  f"cpu {r['process_cpu_s'] / max(p['process_cpu_s'], 1e-9):.2f}x, "
                  f"peak RSS {r['peak_rss_mb'] / p['peak_rss_mb']:.2f}x, perplexity {r['perplexity'] / p['perplexity']:.4f}x")
    if args.json:
        print(json.dumps({"original_perplexity": base["perplexity"], "llmcompressor_version": peer_version, "rows": rows}))


if __name__ == "__main__":
    main()
