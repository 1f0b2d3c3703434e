#!/usr/bin/env python
"""Quantization wall time, peak RSS and held-out perplexity, side by side, from one run.

Each quantize runs in its own subprocess (so peak RSS is that run's alone) through the real CLI,
then every checkpoint is scored by `quantkit eval` on the same held-out Lee tokens. With
--llmcompressor-python PATH (a separate venv where llm-compressor is installed) the same model,
scheme and calibration text also go through llm-compressor's GPTQModifier / AWQModifier and the
script prints quantkit / llm-compressor ratios. llm-compressor is a benchmark peer only.

    python scripts/bench_quantize.py --methods rtn,gptq --num-samples 64 --seq-len 512
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(cmd: list[str], env=None) -> tuple[dict, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


def quantkit_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "quantkit.cli", *args]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--methods", default="rtn,gptq", help="comma list of quantkit methods (rtn, gptq, gptq-actorder, awq, awq-noclip)")
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
    variants = {"rtn": ("rtn", []), "gptq": ("gptq", []), "gptq-actorder": ("gptq", ["--option", "desc_act=true"]),
                "awq": ("awq", ["--format", "gptq"]), "awq-noclip": ("awq", ["--format", "gptq", "--option", "clip=false"])}
    for name in args.methods.split(","):
        method, extra = variants[name]
        out = work / f"{name}-w{args.bits}g{args.group_size}"
        summary, wall = run(quantkit_cli("quantize", "--model", args.model, "--method", method, "--bits", str(args.bits),
                                         "--group-size", args.group_size, "--num-samples", str(args.num_samples),
                                         "--seq-len", str(args.seq_len), "--output", str(out), "--overwrite", "--json", *extra))
        rows.append({"tool": "quantkit", "variant": name, "path": str(out), "quantize_s": summary["seconds"],
                     "process_s": round(wall, 1), "peak_rss_mb": summary["peak_rss_mb"]})
    if args.llmcompressor_python:
        for name in args.methods.split(","):
            if name not in ("gptq", "awq", "rtn"):
                continue
            out = work / f"llmc-{name}-w{args.bits}g{args.group_size}"
            summary, wall = run([args.llmcompressor_python, str(HERE / "llmcompressor_peer.py"), "--method", name,
                                 "--model", args.model, "--bits", str(args.bits), "--group-size", args.group_size,
                                 "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len), "--output", str(out)])
            rows.append({"tool": "llm-compressor", "variant": name, "path": str(out), "quantize_s": summary["seconds"],
                         "process_s": round(wall, 1), "peak_rss_mb": summary["peak_rss_mb"]})
    eval_args = ["--json"] + (["--max-windows", str(args.max_windows)] if args.max_windows else [])
    base, _ = run(quantkit_cli("eval", "--model", args.model, *eval_args))
    for row in rows:
        r, _ = run(quantkit_cli("eval", "--model", row["path"], "--backend", "reference", *eval_args))
        row["perplexity"] = round(r["perplexity"], 4)
        row["ppl_ratio_vs_original"] = round(r["perplexity"] / base["perplexity"], 4)
    print(f"original perplexity {base['perplexity']:.4f} over {base['tokens']} held-out tokens ({base['windows']} windows)")
    print(f"{'tool':15} {'variant':14} {'quantize s':>10} {'peak RSS MB':>11} {'ppl':>9} {'ppl/orig':>8}")
    for r in rows:
        print(f"{r['tool']:15} {r['variant']:14} {r['quantize_s']:10.1f} {r['peak_rss_mb']:11.0f} {r['perplexity']:9.4f} "
              f"{r['ppl_ratio_vs_original']:8.4f}")
    peers = {(r["variant"]): r for r in rows if r["tool"] == "llm-compressor"}
    for r in rows:
        p = peers.get(r["variant"])
        if r["tool"] == "quantkit" and p:
            print(f"quantkit/llm-compressor {r['variant']}: time {r['quantize_s'] / p['quantize_s']:.2f}x, "
                  f"peak RSS {r['peak_rss_mb'] / p['peak_rss_mb']:.2f}x, perplexity {r['perplexity'] / p['perplexity']:.4f}x")
    if args.json:
        print(json.dumps({"original_perplexity": base["perplexity"], "rows": rows}))


if __name__ == "__main__":
    main()
