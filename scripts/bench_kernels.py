#!/usr/bin/env python
"""Benchmark quantkit's Triton GEMMs against fp16 torch.matmul and PyTorch's int4 kernel (GPU only).

For each M and (K x N) shape it times, with ``triton.testing.do_bench``:

* ``dequant_gemm`` W4A16 (GPTQ layout, asymmetric, group 128 by default),
* ``torch.matmul`` on the same weight in fp16 (the baseline),
* ``torch.ops.aten._weight_int4pack_mm`` (tinygemm, bf16 activations) after
  ``_convert_weight_to_int4pack``,
* W8A8 (``per_token_quant_int8`` + ``int8_gemm``, activation quantization included),
* 4-bit, M <= 16: ``marlin_gemm`` on the same weight shuffled into Marlin's layout at set-up
  (``marlin_layout.shuffle``; issue #49's first split-K kernel on it, never run on a GPU before this
  script runs it: its column is its first measurement),

and prints time, TFLOP/s, effective GB/s (bytes the W4A16 call must move: packed weight, scales,
zeros, x, y) and speedups. The weight-only int4 ceiling in the memory-bound regime is about
16 / 4.125 = 3.9x over fp16 (group 128, fp16 scales). ``--json PATH`` also writes the rows.

Without CUDA it refuses with one line and exit code 2: interpreter timings would mean nothing.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import sys
import types

DEFAULT_MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024]
DEFAULT_SHAPES = ["4096x4096", "8192x8192", "4096x14336", "14336x4096"]  # K x N


def _refuse(msg: str) -> int:
    print(f"bench_kernels.py: {msg}", file=sys.stderr)
    return 2


def _import_kernels():
    """The GEMMs of ``quantkit.kernels``, installed or from this source tree."""
    try:
        importlib.import_module("quantkit.kernels.dequant_gemm")
    except ImportError:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    dequant = importlib.import_module("quantkit.kernels.dequant_gemm")
    int8 = importlib.import_module("quantkit.kernels.int8_gemm")
    marlin = importlib.import_module("quantkit.kernels.marlin_gemm")
    layout = importlib.import_module("quantkit.kernels.marlin_layout")
    return types.SimpleNamespace(dequant_gemm=dequant.dequant_gemm, w8a8_linear=int8.w8a8_linear,
                                 marlin_gemm=marlin.marlin_gemm, marlin_max_rows=marlin.MAX_ROWS,
                                 marlin_shuffle=layout.shuffle)


def _parse_shape(s: str):
    k, n = s.lower().split("x")
    return int(k), int(n)


def _bench(fn, warmup, rep):
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep)  # milliseconds


def _bench_graph(fn, warmup, rep, calls=20):
    """Milliseconds per call of `fn` replayed from a CUDA graph of `calls` calls: the GPU's own time,
    without the Python and launch overhead that eager timing of a small call mostly measures."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (and autotuning) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return _bench(graph.replay, warmup, rep) / calls


def overhead_breakdown(torch, K, R, shape, bits, gsz, args, dev: str = "cuda") -> None:
    """Where an eager M = 1 dequant-GEMM call's time goes (the first H200 run: 0.06-0.14 ms eager
    against 0.01-0.03 ms replayed from a CUDA graph). Each line is a measured time, not a difference."""
    k, n = shape
    qweight = R.pack_gptq_qweight(torch.randint(0, 2**bits, (k, n), dtype=torch.int32, device=dev), bits)
    scales = (torch.rand(k // gsz, n, device=dev) * 0.01 + 1e-3).half()
    qzeros = R.pack_gptq_qzeros(torch.randint(0, 2**bits, (k // gsz, n), dtype=torch.int32, device=dev), bits)
    x = torch.randn(1, k, dtype=torch.float16, device=dev)
    fixed = {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4}
    eager = lambda fn: _bench(fn, args.warmup, args.rep)  # noqa: E731
    rows = [
        ("dequant_gemm, autotuned, eager", eager(lambda: K.dequant_gemm(x, qweight, scales, qzeros, None, bits, gsz))),
        ("dequant_gemm, fixed config (no autotuner), eager",
         eager(lambda: K.dequant_gemm(x, qweight, scales, qzeros, None, bits, gsz, config=fixed))),
        ("its allocations alone (fp32 zeros + cast), eager",
         eager(lambda: torch.zeros(1, n, dtype=torch.float32, device=dev).to(torch.float16))),
        ("an empty-ish CUDA op (x.add_(0)), eager", eager(lambda: x.add_(0))),
        ("dequant_gemm, autotuned, CUDA-graph replay",
         _bench_graph(lambda: K.dequant_gemm(x, qweight, scales, qzeros, None, bits, gsz), args.warmup, args.rep)),
    ]
    print(f"\n# eager overhead of one M = 1 call, {k}x{n} W{bits}A16 g{gsz} (ms per call)")
    for name, ms in rows:
        print(f"{name:>52}: {ms:.4f}")


def _int4pack_setup(torch, k, n, group_size, device):
    """tinygemm operands (random: only the timing matters). Returns a callable factory or None."""
    try:
        w_u8 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
        packed = torch.ops.aten._convert_weight_to_int4pack(w_u8, 8)
        sz = torch.randn(k // group_size, n, 2, dtype=torch.bfloat16, device=device) * 0.01
        return lambda x_bf16: torch.ops.aten._weight_int4pack_mm(x_bf16, packed, group_size, sz)
    except Exception as exc:  # op missing / signature changed in this torch build
        print(f"  (torch int4pack unavailable: {type(exc).__name__}: {str(exc).splitlines()[0]})", file=sys.stderr)
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)), help="comma-separated M values")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="comma-separated KxN shapes")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8])
    ap.add_argument("--sym", action="store_true", help="symmetric weights (no qzeros)")
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--cuda-graph", action="store_true",
                    help="time every op replayed from a CUDA graph (kernel time without launch overhead)")
    ap.add_argument("--overhead", action="store_true",
                    help="also split one M = 1 call's eager time: autotuner dispatch, allocations, GPU time")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)

    if os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on"):
        return _refuse("TRITON_INTERPRET is set; interpreter timings are meaningless, unset it")
    try:
        import torch
    except ImportError:
        return _refuse("torch is not installed")
    if not torch.cuda.is_available():
        return _refuse("needs a CUDA GPU and none is available; nothing was benchmarked")
    try:
        import triton  # noqa: F401
    except ImportError:
        return _refuse("needs triton, which is not installed")

    K = _import_kernels()
    R = importlib.import_module("quantkit.kernels.reference")
    dev = "cuda"
    ms = [int(v) for v in args.ms.split(",") if v]
    shapes = [_parse_shape(s) for s in args.shapes.split(",") if s]
    bits, gsz = args.bits, args.group_size
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"W{bits}A16 group {gsz} {'sym' if args.sym else 'asym'} | "
          f"{'CUDA-graph replay (no launch overhead)' if args.cuda_graph else 'eager calls (launch overhead included)'}")
    timed = (lambda fn: _bench_graph(fn, args.warmup, args.rep)) if args.cuda_graph else (
        lambda fn: _bench(fn, args.warmup, args.rep))

    rows = []
    hdr = (f"{'K x N':>12} {'M':>5} | {'wq ms':>8} {'TFLOP/s':>8} {'GB/s':>7} | {'fp16 ms':>8} "
           f"{'x fp16':>7} | {'int4pk ms':>9} {'x int4pk':>8} | {'w8a8 ms':>8} {'w8a8 x':>7} | {'relerr':>8} | "
           f"{'marlin ms':>9} {'x fp16':>7} {'relerr':>8}")
    print(hdr)
    print("-" * len(hdr))
    for k, n in shapes:
        g = k // gsz
        pf = 32 // bits
        codes = torch.randint(0, 2**bits, (k, n), dtype=torch.int32, device=dev)
        qweight = R.pack_gptq_qweight(codes, bits)
        del codes
        scales = (torch.rand(g, n, device=dev) * 0.01 + 1e-3).half()
        qzeros = None if args.sym else R.pack_gptq_qzeros(
            torch.randint(0, 2**bits, (g, n), dtype=torch.int32, device=dev), bits)
        w_fp16 = R.dequantize_gptq(qweight, scales, qzeros, None, bits, gsz).half()
        w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev)
        w8_scale = torch.rand(n, device=dev) * 0.01 + 1e-3
        int4mm = _int4pack_setup(torch, k, n, gsz, dev)
        wbytes = k * n * bits / 8 + g * n * 2 + (0 if qzeros is None else g * (n // pf) * 4)
        marlin_w = K.marlin_shuffle(qweight, scales, qzeros, gsz) if bits == 4 and n % 64 == 0 else None
        for m in ms:
            x = torch.randn(m, k, dtype=torch.float16, device=dev)
            y = K.dequant_gemm(x, qweight, scales, qzeros, None, bits, gsz)
            ref = x.float() @ w_fp16.float()
            relerr = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            t_q = timed(lambda: K.dequant_gemm(x, qweight, scales, qzeros, None, bits, gsz))
            t_h = timed(lambda: torch.matmul(x, w_fp16))
            t_i4 = None
            if int4mm is not None:
                xb = x.to(torch.bfloat16)
                try:
                    t_i4 = timed(lambda: int4mm(xb))
                except Exception as exc:
                    print(f"  (int4pack_mm failed at M={m}: {str(exc).splitlines()[0]})", file=sys.stderr)
            t_8 = timed(lambda: K.w8a8_linear(x, w8, w8_scale))
            t_mg = mg_err = None
            if marlin_w is not None and m <= K.marlin_max_rows:
                y_mg = K.marlin_gemm(x, marlin_w)
                mg_err = ((y_mg.float() - ref).abs().max() / ref.abs().max()).item()
                t_mg = timed(lambda: K.marlin_gemm(x, marlin_w))
            flops = 2.0 * m * n * k
            gbs = (wbytes + m * k * 2 + m * n * 2) / (t_q * 1e-3) / 1e9
            row = dict(K=k, N=n, M=m, bits=bits, group_size=gsz, sym=args.sym,
                       wq_ms=t_q, wq_tflops=flops / (t_q * 1e-3) / 1e12, wq_gbs=gbs,
                       fp16_ms=t_h, speedup_vs_fp16=t_h / t_q,
                       int4pack_ms=t_i4, speedup_vs_int4pack=(t_i4 / t_q) if t_i4 else None,
                       w8a8_ms=t_8, w8a8_speedup_vs_fp16=t_h / t_8, max_rel_err=relerr,
                       marlin_ms=t_mg, marlin_speedup_vs_fp16=(t_h / t_mg) if t_mg else None, marlin_rel_err=mg_err)
            rows.append(row)
            i4 = f"{t_i4:9.4f} {t_i4 / t_q:7.2f}x" if t_i4 else f"{'n/a':>9} {'n/a':>8}"
            mg = f"{t_mg:9.4f} {t_h / t_mg:6.2f}x {mg_err:8.1e}" if t_mg else f"{'n/a':>9} {'n/a':>7} {'':>8}"
            print(f"{f'{k}x{n}':>12} {m:>5} | {t_q:8.4f} {row['wq_tflops']:8.2f} {gbs:7.0f} | "
                  f"{t_h:8.4f} {t_h / t_q:6.2f}x | {i4} | {t_8:8.4f} {t_h / t_8:6.2f}x | {relerr:8.1e} | {mg}")
        del qweight, scales, qzeros, w_fp16, w8, int4mm, marlin_w
        torch.cuda.empty_cache()

    if args.overhead:
        overhead_breakdown(torch, K, R, shapes[0], bits, gsz, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda_graph=args.cuda_graph,
                           triton=triton.__version__, rows=rows), f, indent=2)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
