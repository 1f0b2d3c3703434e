#!/usr/bin/env python
"""Allocation to a size budget against uniform schemes, side by side, on one model.

1. `quantkit.sensitivity` measures the model's table (kept in WORKDIR/sensitivity; reused when there):
   every linear alone at every candidate, the whole model at every uniform candidate (the
   interaction mapping's points) and a few allocated mixtures (the mapping's out-of-sample check),
   on held-out windows spread over the second half of each text.
2. The uniform default (`--method M` at 4 bits and the default group size) is quantized, and the
   allocated mixture at exactly its file size (`target_size`), then mixtures at each `--target-bits`,
   and the uniform schemes named by `--uniform` for reference.
3. Every checkpoint is scored against the original on held-out lee and wiki from the START of the
   texts (mean KL per token over `--eval-windows` windows of 512 tokens each).
Printed: bits per weight and file bytes, measured KL on each text and their mean, the predicted KL
(the sensitivity report's: the mapped sum of single-linear KLs) and predicted / measured, and each
mixture's KL against the uniform default's.

    OMP_NUM_THREADS=2 nice -n 10 python scripts/bench_allocation.py --workdir /work/scratch/alloc48 \\
        --candidates w2g64,w3g64,w3g32,w4pc,w4g64,w4g32,w8pc --num-samples 16 --seq-len 256 \\
        --sens-windows 2 --sens-seq-len 128 --eval-windows 4 --target-bits 3.0,2.5 --uniform w3g64,w2g64
"""
from __future__ import annotations

import argparse
import json
import re
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
    ap.add_argument("--candidates", default="w2g64,w3g64,w3g32,w4pc,w4g64,w4g32,w8pc",
                    help="candidate schemes per linear (bit widths or labels)")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--sens-dataset", default="lee,wiki", help="held-out texts of the sensitivity measurements")
    ap.add_argument("--sens-windows", type=int, default=2, help="held-out windows per text per sensitivity measurement")
    ap.add_argument("--sens-seq-len", type=int, default=128)
    ap.add_argument("--eval-windows", type=int, default=4, help="held-out windows of 512 scored per text")
    ap.add_argument("--target-bits", default="3.0,2.5", help="further budgets (average bits per weight), comma-separated")
    ap.add_argument("--uniform", default="", help="uniform schemes quantized for reference, e.g. w3g64,w2g64")
    args = ap.parse_args()

    import quantkit
    from quantkit import api
    from quantkit.plan import resolve_plan

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    sens = work / "sensitivity"
    t0 = time.perf_counter()
    if not (sens / "sensitivity.json").exists():
        cands = tuple(int(c) if c.isdigit() else c for c in args.candidates.split(","))
        api.sensitivity(args.model, args.method, num_samples=args.num_samples, seq_len=args.seq_len,
                        eval_dataset=args.sens_dataset, eval_windows=args.sens_windows, eval_seq_len=args.sens_seq_len,
                        candidate_bits=cands, output=sens, overwrite=True)
        print(f"sensitivity measured in {time.perf_counter() - t0:.0f} s", flush=True)
    report = json.loads((sens / "sensitivity.json").read_text())
    calibrates = resolve_plan(args.method).calibration is not None  # RTN reads no data: no calibration flags
    common = dict(overwrite=True, progress=False,
                  **(dict(num_samples=args.num_samples, seq_len=args.seq_len) if calibrates else {}))

    def checkpoint(name: str, **kw) -> tuple[Path, dict]:
        out = work / name
        if not (out / "config.json").exists():
            result = quantkit.quantize(args.model, args.method, output=out, **common, **kw)
            (out / "bench_result.json").write_text(json.dumps(result.get("allocation") or {}))
        return out, json.loads((out / "bench_result.json").read_text())

    runs = {}  # row -> (folder, predicted KL or None)
    out_u, _ = checkpoint("uniform-default", bits=4)
    cfg = json.loads((out_u / "config.json").read_text())["quantization_config"]
    default = f"w{cfg['bits']}g{cfg['group_size']}" if cfg["group_size"] != -1 else f"w{cfg['bits']}pc"
    runs[f"uniform {default} (default)"] = (out_u, (report["uniform"].get(default) or {}).get("predicted_kl"))
    size = files_bytes(out_u)
    out_m, alloc = checkpoint(f"allocated-size-{size}", target_size=str(size), sensitivity=sens)
    runs["allocated, same size"] = (out_m, alloc["predicted_kl"])
    for label in [u for u in args.uniform.split(",") if u]:
        m = re.fullmatch(r"w(\d+)(?:g(\d+)|pc)", label)
        folder, _ = checkpoint(f"uniform-{label}", bits=int(m.group(1)), group_size=int(m.group(2) or -1))
        runs[f"uniform {label}"] = (folder, (report["uniform"].get(label) or {}).get("predicted_kl"))
    for bits in [float(b) for b in args.target_bits.split(",") if b]:
        folder, a = checkpoint(f"allocated-{bits}bits", target_bits=bits, sensitivity=sens)
        runs[f"allocated {bits} bits"] = (folder, a["predicted_kl"])

    print(f"\nmodel {args.model}, {args.method}, calibration {args.num_samples} x {args.seq_len} lee; sensitivity: "
          f"{report['calibration_mode']} mode on {report['eval']['windows']} x {report['eval']['seq_len']} held-out "
          f"tokens ({report['eval']['dataset']}, spread over the texts' second halves), "
          f"candidates {', '.join(report['schemes'])}; "
          f"scored on {args.eval_windows} x 512 tokens per text from the texts' starts")
    print("interaction mapping (whole model, sensitivity windows): " + ", ".join(
        f"{p['scheme']} sum {p['predicted_kl_sum']:.4g} -> {p['measured_kl']:.4g}" for p in report["interaction"]["fit"]))
    print("out-of-sample mixtures (sensitivity windows): " + ", ".join(
        f"{c['bits_per_weight']:.3f} b/w predicted {c['predicted_kl']:.4g} measured {c['measured_kl']:.4g}"
        for c in report["interaction"]["check"]))
    print(f"\n{'row':<28} {'bits/w':>7} {'file bytes':>11} {'KL lee':>17} {'KL wiki':>17} {'mean':>8} "
          f"{'predicted':>9} {'pred/meas':>9}  schemes")
    means = {}
    for name, (folder, predicted) in runs.items():
        kl = {text: score(folder, args.model, text, args.eval_windows) for text in ("lee", "wiki")}
        means[name] = (kl["lee"][0] + kl["wiki"][0]) / 2
        sizes = _linear_bits(folder)
        ratio = f"{predicted / means[name]:>9.3f}" if predicted else f"{'-':>9}"
        pred = f"{predicted:>9.5f}" if predicted else f"{'-':>9}"
        schemes = json.loads((folder / "bench_result.json").read_text()).get("schemes", "")
        print(f"{name:<28} {sizes:>7.4f} {files_bytes(folder):>11} {kl['lee'][0]:>9.5f}±{kl['lee'][1]:.5f} "
              f"{kl['wiki'][0]:>9.5f}±{kl['wiki'][1]:.5f} {means[name]:>8.5f} {pred} {ratio}  {schemes}", flush=True)
    u = means[f"uniform {default} (default)"]
    for name, m in means.items():
        if name.startswith("allocated"):
            change = f"{100 * (1 - m / u):.1f} % lower" if m <= u else f"{100 * (m / u - 1):.1f} % higher"
            print(f"{name} / uniform {default} mean KL: {m / u:.3f} ({change})")
    print(f"total {time.perf_counter() - t0:.0f} s (2 shared cores: contended)")
    return 0


def score(folder: Path, model: str, text: str, windows: int) -> tuple[float, float]:
    """Mean KL per token against `model` on `windows` x 512 held-out tokens of `text` (kept in the
    checkpoint's folder, so a rerun or a parallel job scores each checkpoint once)."""
    from quantkit import api

    cache = folder / f"bench_kl_{text}_{windows}x512.json"
    if not cache.exists():
        r = api.evaluate(folder, baseline=model, dataset=text, seq_len=512, max_windows=windows)
        cache.write_text(json.dumps([r["kl_mean"], r["kl_mean_stderr"] or 0.0]))
    return tuple(json.loads(cache.read_text()))


def _linear_bits(folder: Path) -> float:
    """Average bits per weight of the quantized linears, counted from the written packed tensors
    (qweight, qzeros, scales, g_idx; a linear's weights: g_idx's length x scales' columns)."""
    from safetensors import safe_open

    itemsize = {"I32": 4, "F16": 2, "BF16": 2, "F32": 4}
    nbytes, shapes = 0, {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                owner, _, leaf = key.rpartition(".")
                if leaf in ("qweight", "qzeros", "scales", "g_idx"):
                    t = st.get_slice(key)
                    shape = t.get_shape()
                    nbytes += itemsize[t.get_dtype()] * (shape[0] * (shape[1] if len(shape) > 1 else 1))
                    shapes.setdefault(owner, {})[leaf] = shape
    weights = sum(s["g_idx"][0] * s["scales"][1] for s in shapes.values())
    return 8 * nbytes / weights if weights else float("nan")


if __name__ == "__main__":
    sys.exit(main())
