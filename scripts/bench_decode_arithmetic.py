#!/usr/bin/env python
"""What the cpu backend's decode kernels (kernels.cpu_gemv: activations quantized to int8 per block
of 32, llama.cpp's arithmetic) cost in quality against PyTorch's bf16 kernels, on held-out text.

The cpu backend takes the int8-activation kernels up to ``backends.DECODE_ROWS`` rows (decode) and
PyTorch's kernels above (prefill, eval). Here the limit is set to "every call" and then to "none",
and the same int4 checkpoint is scored both ways against the fp32 demo model (``quantkit.evaluate``:
mean and p99 KL per token, top-1 agreement, perplexity) on the same held-out windows of each corpus,
so the two arithmetics are compared on exactly the tokens, with the checkpoint's own quantization
error as the yardstick.

    python scripts/bench_decode_arithmetic.py --windows 16 --json out.json
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="an int4 checkpoint (default: RTN w4g64 of the demo, made here)")
    ap.add_argument("--datasets", default="lee,wiki")
    ap.add_argument("--windows", type=int, default=16, help="512-token held-out windows per dataset")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import quantkit
    from quantkit.runtime import backends

    if backends.cpu_decode_kernel() is None:
        raise SystemExit("the decode kernels are unavailable here (see the notice above)")
    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = str(Path(tempfile.mkdtemp(prefix="qk-arith-")) / "demo-rtn-w4g64")
        quantkit.quantize("demo", "rtn", bits=4, group_size=64, output=ckpt, progress=False)
    arithmetics = {"PyTorch int4 kernel (bf16 activations)": 0, "quantkit decode kernel (int8 activations)": 10 ** 9}
    results: dict = {}
    limit = backends.DECODE_ROWS
    try:
        for dataset in args.datasets.split(","):
            for name, rows in arithmetics.items():
                backends.DECODE_ROWS = rows
                r = quantkit.evaluate(ckpt, baseline="demo", dataset=dataset, max_windows=args.windows, backend="cpu",
                                      batch_size=1)
                results[(dataset, name)] = r
                print(f"[arith] {dataset:5s} {name}: KL {r['kl_mean']:.5f}, ppl {r['perplexity']:.3f}", flush=True)
    finally:
        backends.DECODE_ROWS = limit
    print(f"\n{ckpt} against the fp32 demo model, {args.windows} x 512-token held-out windows per dataset")
    print(f"{'dataset':8s} {'arithmetic':44s} {'tokens':>7s} {'KL mean':>9s} {'KL p99':>8s} {'top-1':>7s} {'ppl':>8s}")
    for (dataset, name), r in results.items():
        print(f"{dataset:8s} {name:44s} {r['tokens']:7d} {r['kl_mean']:9.5f} {r['kl_p99']:8.4f} "
              f"{r['top1_agreement']:7.4f} {r['perplexity']:8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{d}|{n}": r for (d, n), r in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
