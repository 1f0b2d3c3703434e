#!/usr/bin/env python
"""Allocation to a size budget against the uniform default, side by side, on one model.

1. `quantkit.sensitivity` measures the model's table (kept in WORKDIR/sensitivity; reused when there).
2. The uniform default (GPTQ w4 at the default group size) is quantized, and the allocated mixture
   at exactly its size (its packed bytes plus the same unquantized tensors: `target_size`).
3. Both are scored against the original on held-out lee and wiki (mean KL per token).
Printed: bits per weight and file bytes of both, measured KL on each text, the predicted KL (sum
of per-linear predicted increments: the additivity assumption) and predicted / measured, and the
mixture's KL against the uniform's.

    nice -n 10 python scripts/bench_allocation.py --workdir /work/scratch/alloc \\
        --num-samples 64 --seq-len 512 --eval-windows 8
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path


def files_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--method", default="gptq")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--sens-windows", type=int, default=8, help="held-out windows per sensitivity measurement")
    ap.add_argument("--sens-seq-len", type=int, default=512)
    ap.add_argument("--sample", type=int, default=8, help="single linears measured to check the proxy")
    ap.add_argument("--eval-windows", type=int, default=8, help="held-out windows of 512 scored per text")
    ap.add_argument("--no-measure-layers", action="store_true",
                    help="calibrate the proxy on the sampled linears only (one factor per scheme)")
    args = ap.parse_args()

    import quantkit
    from quantkit import api

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    sens = work / "sensitivity"
    t0 = time.perf_counter()
    if not (sens / "sensitivity.json").exists():
        api.sensitivity(args.model, args.method, num_samples=args.num_samples, seq_len=args.seq_len,
                        eval_windows=args.sens_windows, eval_seq_len=args.sens_seq_len, sample=args.sample,
                        measure_layers=not args.no_measure_layers, output=sens, overwrite=True)
        print(f"sensitivity measured in {time.perf_counter() - t0:.0f} s", flush=True)
    report = json.loads((sens / "sensitivity.json").read_text())
    default = next(l for l in report["schemes"] if l.startswith("w4"))
    uniform = report["uniform"][default]
    from quantkit.plan import resolve_plan

    calibrates = resolve_plan(args.method).calibration is not None  # RTN reads no data: no calibration flags
    common = dict(overwrite=True, progress=False,
                  **(dict(num_samples=args.num_samples, seq_len=args.seq_len) if calibrates else {}))
    runs = {}
    out_u = work / f"uniform-{default}"
    if not (out_u / "config.json").exists():
        quantkit.quantize(args.model, args.method, output=out_u, **common)
    size = files_bytes(out_u)
    out_m = work / "allocated"
    shutil.rmtree(out_m, ignore_errors=True)
    result = quantkit.quantize(args.model, args.method, output=out_m, target_size=str(size), sensitivity=sens,
                               **common)
    alloc = result["allocation"]
    runs["uniform " + default] = (out_u, uniform["predicted_kl"], uniform["bits_per_weight"])
    runs["allocated"] = (out_m, alloc["predicted_kl"], alloc["bits_per_weight"])
    print(f"\nmodel {args.model}, {args.method}, calibration {args.num_samples} x {args.seq_len} lee (the proxy's "
          f"Hessians{', and the method' if calibrates else ''}); sensitivity on "
          f"{report['eval']['windows']} x {report['eval']['seq_len']} held-out lee, calibrated per "
          f"{report['calibration_mode']}; proxy check: {json.dumps(report['proxy_check'])}")
    print(f"allocated schemes: {alloc['schemes']}")
    scores = {}
    for name, (folder, _, _) in runs.items():
        for text in ("lee", "wiki"):
            r = api.evaluate(folder, baseline=args.model, dataset=text, seq_len=512, max_windows=args.eval_windows)
            scores[(name, text)] = (r["kl_mean"], r["kl_mean_stderr"])
    print(f"\n{'row':<18} {'bits/w':>7} {'file bytes':>11} {'KL lee':>16} {'KL wiki':>16} {'mean':>8} "
          f"{'predicted':>9} {'pred/meas':>9}")
    means = {}
    for name, (folder, predicted, bpw) in runs.items():
        (kl_l, e_l), (kl_w, e_w) = scores[(name, "lee")], scores[(name, "wiki")]
        means[name] = (kl_l + kl_w) / 2
        print(f"{name:<18} {bpw:>7.4f} {files_bytes(folder):>11} {kl_l:>9.5f}±{e_l or 0:.5f} {kl_w:>9.5f}±{e_w or 0:.5f} "
              f"{means[name]:>8.5f} {predicted:>9.5f} {predicted / means[name]:>9.3f}")
    u, m = means["uniform " + default], means["allocated"]
    change = f"{100 * (1 - m / u):.1f} % lower" if m <= u else f"{100 * (m / u - 1):.1f} % higher"
    print(f"\nallocated / uniform mean KL: {m / u:.3f} ({change}); "
          f"total {time.perf_counter() - t0:.0f} s (2 shared cores: contended)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
