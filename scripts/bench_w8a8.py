"""W8A8 linear on CPU against dense fp32 and bf16 matmul, and (--full) a whole SmoothQuant run.

Why: the W8A8 runtime's CPU speed depends on which exact int32 GEMM torch offers here, so the
numbers are measured, not assumed. Per shape (the demo model's 576x576, 576->1536, 1536->576, and
4096x4096) and M in 1, 16, 128, 512 it times, in one run:
    fp32      F.linear on an fp32 weight (the baseline; ratios are time / fp32 time)
    bf16      F.linear on a bf16 weight
    w8a8      QuantLinear's cpu W8A8 path end to end (per-token int8 quantization, exact int32
              accumulator, fp32 epilogue) with the default gemm ("fp32": exact chunked fp32 BLAS)
    int_mm    the same with QUANTKIT_W8A8_CPU_GEMM=int_mm (torch._int_mm)
Each entry is the best of a few repeats (fewer for slow calls). --full then quantizes the demo model
with SmoothQuant (alpha from configs/smoothquant-w8a8-llama.yaml), writes the checkpoint, and reports
wall time and held-out perplexity through quantkit.load(backend="cpu") next to the original's
and plain W8A8 (no smoothing).

    python scripts/bench_w8a8.py [--threads 1] [--m 1 16 128 512] [--full [--auto] --num-samples 128 --windows 16]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = [(576, 576), (576, 1536), (1536, 576), (4096, 4096)]  # (in K, out N)


def best_time(fn, budget_s: float = 0.5, max_reps: int = 30) -> float:
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if first > 1.0:  # a slow call is timed once (its first run already warmed it)
        return first
    times = []
    while len(times) < max_reps and (sum(times) < budget_s or len(times) < 3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_linear(ms: list[int]) -> None:
    from quantkit.quantizers.grid import rtn_quantize
    from quantkit.runtime.w8a8 import W8A8Cpu

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'K->N':>11} {'M':>4} {'fp32 ms':>9} {'bf16/fp32':>9} {'w8a8/fp32':>9} {'int_mm/fp32':>11}")
    for k, n in SHAPES:
        w = torch.randn(n, k) * 0.02
        qw = rtn_quantize(w, 8, -1, True)
        qw.input_quant = {"strategy": "token", "dynamic": True}
        fast, intmm = W8A8Cpu(qw, torch.device("cpu"), gemm="fp32"), W8A8Cpu(qw, torch.device("cpu"), gemm="int_mm")
        wb = w.bfloat16()
        for m in ms:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            with torch.no_grad():
                t32 = best_time(lambda: F.linear(x, w))
                tb = best_time(lambda: F.linear(xb, wb))
                tq = best_time(lambda: fast(x))
                ti = best_time(lambda: intmm(x))
            print(f"{k:>5}->{n:<5} {m:>4} {t32 * 1e3:>9.3f} {tb / t32:>9.2f} {tq / t32:>9.2f} {ti / t32:>11.2f}",
                  flush=True)


def bench_full(num_samples: int, windows: int, seq_len: int = 512, auto: bool = False) -> None:
    import quantkit
    from quantkit import data
    from quantkit.scoring import perplexity
    from quantkit.runtime.loader import load_tokenizer
    from quantkit.plan import read_recipe_file as load_recipe

    alpha = load_recipe("smoothquant-w8a8-llama")["options"]["alpha"]
    stream = data.eval_token_stream("lee", load_tokenizer("demo"))

    def ppl(path) -> float:
        model = quantkit.load(path, backend="cpu")
        return perplexity(model, stream, seq_len=seq_len, max_windows=windows, batch_size=4)["perplexity"]

    print(f"\ndemo model, {num_samples}x{seq_len} calibration tokens (lee), {windows} held-out windows of {seq_len}")
    print(f"original: ppl {ppl('demo'):.3f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [("w8a8, no smoothing", {"smooth": False}), ("w8a8 smoothquant alpha 0.5", {"alpha": 0.5}),
                (f"w8a8 smoothquant alpha {alpha} (config)", {"alpha": alpha})]
        if auto:
            runs.append(("w8a8 smoothquant alpha auto (per-layer search)", {"alpha": "auto"}))
        for label, options in runs:
            out = Path(tmp) / label.replace(" ", "_").replace(",", "")
            t0 = time.perf_counter()
            quantkit.quantize("demo", "smoothquant", output=out, num_samples=num_samples, seq_len=seq_len,
                              options=options, progress=False)
            secs = time.perf_counter() - t0
            print(f"{label}: ppl {ppl(out):.3f}  (quantize + write {secs:.0f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 128, 512])
    ap.add_argument("--full", action="store_true", help="also quantize the demo model and measure perplexity")
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--auto", action="store_true", help="with --full: also alpha auto (slow: an 11-point search per layer)")
    ap.add_argument("--skip-linear", action="store_true", help="only the --full part")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1 gives stable ratios on a shared machine; default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.skip_linear:
        bench_linear(args.m)
    if args.full:
        bench_full(args.num_samples, args.windows, auto=args.auto)


if __name__ == "__main__":
    main()
