#!/usr/bin/env python
"""GPTQ on a Mixture-of-Experts model: quantkit against llm-compressor, side by side, from one run.

A random Qwen3-MoE-shaped model (scripts/moe_models.py; default 8 layers, 16 experts, top-2, hidden
512, expert width 256) is quantized W4 g128 symmetric, no act-order, by both tools on exactly the
same calibration token ids (drawn once with quantkit's pipeline, bench_quantize.write_calibration_ids).
llm-compressor (its own venv, scripts/llmcompressor_peer.py) linearizes the experts and by default
runs every token through every expert; quantkit runs once with `--moe-calibration all` (the same
work) and once with its default. Each run is its own process (peak RSS is that run's alone);
"quantize s" is load + calibrate + write for both. Every checkpoint is then scored against the
original on held-out Lee text (KL divergence of the next-token distribution, top-1 agreement).

    nice python scripts/bench_moe.py --llmcompressor-python /work/peer-venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_quantize import quantkit_cli, run, write_calibration_ids  # noqa: E402
from moe_models import random_qwen3_moe  # noqa: E402


def quantkit_row(model: Path, out: Path, args, policy: str) -> dict:
    summary, wall = run(quantkit_cli("quantize", "--model", str(model), "--method", "gptq", "--bits", "4",
                                     "--group-size", "128", "--no-desc-act", "--format", "compressed-tensors",
                                     "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
                                     *(["--moe-calibration", policy] if policy != "default" else []),
                                     "--output", str(out), "--overwrite", "--json"))
    return {"tool": "quantkit", "variant": f"gptq ({policy})", "path": str(out), "quantize_s": summary["seconds"],
            "process_s": round(wall, 1), "process_cpu_s": summary["_cpu_s"], "peak_rss_mb": summary["peak_rss_mb"]}


def peer_row(model: Path, out: Path, calib_ids: Path, args) -> dict:
    summary, wall = run([args.llmcompressor_python, str(HERE / "llmcompressor_peer.py"), "--method", "gptq",
                         "--model", str(model), "--bits", "4", "--group-size", "128", "--calib-ids", str(calib_ids),
                         "--output", str(out), "--batch-size", str(args.peer_batch_size)])
    return {"tool": "llm-compressor", "variant": "gptq (all)", "path": str(out), "version": summary["llmcompressor_version"],
            "quantize_s": summary["total_seconds"], "oneshot_s": summary["seconds"], "process_s": round(wall, 1),
            "process_cpu_s": summary["_cpu_s"], "peak_rss_mb": summary["peak_rss_mb"]}


def score(row: dict, model: Path, args) -> None:
    r, _ = run(quantkit_cli("eval", "--model", row["path"], "--baseline", str(model), "--backend", "reference",
                            "--seq-len", "256", "--max-windows", str(args.max_windows), "--no-baseline-cache", "--json"))
    row.update(kl_mean=r["kl_mean"], top1=r["top1_agreement"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--moe-intermediate", type=int, default=256)
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-windows", type=int, default=12)
    ap.add_argument("--llmcompressor-python", default=None, help="python of a venv with llm-compressor installed")
    ap.add_argument("--peer-batch-size", type=int, default=1, help="llm-compressor's oneshot batch size (its default 1)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    from quantkit.assets import demo_model_dir

    work = Path(args.workdir or tempfile.mkdtemp(prefix="qk-bench-moe-"))
    model = random_qwen3_moe(work / "model", tokenizer_from=Path(demo_model_dir()), layers=args.layers,
                             experts=args.experts, hidden=args.hidden, moe_intermediate=args.moe_intermediate)
    rows = [quantkit_row(model, work / f"quantkit-{p}", args, p) for p in ("all", "default")]
    if args.llmcompressor_python:
        calib_ids = work / "calib_ids.safetensors"
        write_calibration_ids(str(model), args.num_samples, args.seq_len, calib_ids)
        rows.append(peer_row(model, work / "llmc", calib_ids, args))
    for row in rows:
        try:
            score(row, model, args)
        except SystemExit as exc:  # a checkpoint quantkit cannot read is reported, not fatal
            row["score_error"] = str(exc).splitlines()[0][:200]
    print(f"random Qwen3-MoE: {args.layers} layers, {args.experts} experts top-2, hidden {args.hidden}, expert width "
          f"{args.moe_intermediate}; GPTQ w4 g128 sym; calibration {args.num_samples} x {args.seq_len} tokens")
    print(f"{'tool':15} {'variant':15} {'quantize s':>10} {'process cpu s':>13} {'peak RSS MB':>11} {'KL mean':>9} "
          f"{'top-1':>7}")
    for r in rows:
        kl = f"{r['kl_mean']:9.5f} {r['top1']:7.4f}" if "kl_mean" in r else f"{'n/a':>9} {'n/a':>7}"
        print(f"{r['tool']:15} {r['variant']:15} {r['quantize_s']:10.1f} {r['process_cpu_s']:13.1f} "
              f"{r['peak_rss_mb']:11.0f} {kl}")
    peer = next((r for r in rows if r["tool"] == "llm-compressor"), None)
    if peer is not None:
        print(f"llm-compressor {peer['version']}: oneshot() alone {peer['oneshot_s']:.1f} s")
        for r in rows[:2]:
            print(f"quantkit {r['variant']} / llm-compressor: time {r['quantize_s'] / peer['quantize_s']:.2f}x, "
                  f"cpu {r['process_cpu_s'] / max(peer['process_cpu_s'], 1e-9):.2f}x, "
                  f"peak RSS {r['peak_rss_mb'] / peer['peak_rss_mb']:.2f}x")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
