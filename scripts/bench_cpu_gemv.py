#!/usr/bin/env python
"""quantkit's CPU decode kernels (kernels.cpu_gemv) against PyTorch's packed int4 / int8 kernels,
side by side on the demo model's shapes, at the row counts of decode and speculative verification;
and the fp32 kernel against ``F.linear`` and ``engine.sliced_linear.linear_fn`` (what the engine
calls for an unquantized model today) at the row counts of speculative verification.

Each (shape, rows) pair times the kernels in alternation (``--rounds`` rounds of ``--calls``
calls each, this machine's speed drifting within minutes) and prints the median ms per call and
the ratio PyTorch / quantkit. Random codes and scales: speed does not depend on the values.
The fp32 weights of one shape (7 MB for 576 x 3072) stay in a large L3 between calls; ``--cold``
cycles through copies of each fp32 weight worth >= 128 MB, so that every call streams it from
memory, as a decode step of a whole model does.

    python scripts/bench_cpu_gemv.py --threads 2
    python scripts/bench_cpu_gemv.py --threads 2 --kinds fp32 --cold
"""
from __future__ import annotations

import argparse
import statistics
import time

# (in, out) of the demo's fused q/k/v, o, fused gate/up, down, and the LM head
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
F32_SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 49152)]
COLD_BYTES = 128 << 20  # more than any L3 here: --cold cycles through this much of each fp32 weight


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", default="1,4,9,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--kinds", default="int4,int8,fp32", help="which of int4, int8, fp32 to time")
    ap.add_argument("--f32-rows", default="1,2,3,4,5,9", help="row counts for fp32 (speculative verification: k + 1)")
    ap.add_argument("--cold", action="store_true", help="fp32: a fresh copy of the weight each call (from memory)")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")

    import torch

    from quantkit.runtime import backends

    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = backends.cpu_decode_kernel()
    if kernels is None:
        raise SystemExit("quantkit's CPU decode kernels are unavailable here (see the notice above)")
    g = torch.Generator().manual_seed(0)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        return (time.perf_counter() - t0) / args.calls * 1e3

    print(f"device cpu ({torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}, median of {args.rounds} alternating rounds x {args.calls} calls, ms per call")
    if {"int4", "int8"} & set(kinds):
        print(f"{'weight':6s} {'K x N':>11s} {'rows':>5s} {'quantkit':>9s} {'PyTorch':>9s} {'PyTorch/quantkit':>17s}")
    for bits in [b for b in (4, 8) if f"int{b}" in kinds]:
        for k, n in SHAPES:
            if bits == 4:
                codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
                scales, zeros = torch.rand(n, k // 64, generator=g) * 0.01, torch.full((n, k // 64), 8.0)
                ours = kernels.prepare_int4(codes, scales, zeros, 64)
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
                sz = torch.stack([scales.t(), (8 - zeros.t()) * scales.t()], -1).to(torch.bfloat16).contiguous()
                theirs = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(  # noqa: E731
                    x.to(torch.bfloat16), packed, 64, sz).float()
            else:
                w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
                scales = torch.rand(n, 1, generator=g) * 0.01
                ours = kernels.prepare_int8(w, scales)
                s16 = scales[:, 0].to(torch.bfloat16)
                theirs = lambda x: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), w, s16).float()  # noqa: E731
            for m in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(m, k, generator=g)
                ours(x), theirs(x)  # warm-up
                a, b = [], []
                for _ in range(args.rounds):
                    a.append(timed(lambda: ours(x)))
                    b.append(timed(lambda: theirs(x)))
                qa, qb = statistics.median(a), statistics.median(b)
                print(f"int{bits:<3d} {k:>5d}x{n:<5d} {m:5d} {qa:9.4f} {qb:9.4f} {qb / qa:16.2f}x", flush=True)
    if "fp32" in kinds:
        bench_f32(args, kernels, g, timed)
    return 0


def bench_f32(args, kernels, g, timed) -> None:
    """fp32 weight x fp32 rows: quantkit's kernel, plain F.linear, and linear_fn (F.linear with the output
    rows sliced over the threads where that is exact); `rows/1` is quantkit's time over its own 1-row time."""
    import torch
    import torch.nn.functional as F

    from quantkit.engine.sliced_linear import linear_fn

    print(f"\nfp32 weights{' (cold: from memory every call)' if args.cold else ''}")
    print(f"{'K x N':>11s} {'rows':>5s} {'quantkit':>9s} {'F.linear':>9s} {'linear_fn':>9s} "
          f"{'F.linear/qk':>12s} {'linear_fn/qk':>13s} {'qk rows/1':>10s}")
    for k, n in F32_SHAPES:
        copies = -(-COLD_BYTES // (n * k * 4)) if args.cold else 1
        weights = [torch.randn(n, k, generator=g) * 0.05 for _ in range(copies)]
        fns = [[kernels.prepare_f32(w) for w in weights],
               [(lambda x, w=w: F.linear(x, w)) for w in weights],
               [linear_fn(w) for w in weights]]
        one_row = None
        for m in [int(r) for r in args.f32_rows.split(",")]:
            x = torch.randn(m, k, generator=g)
            turn = [0]

            def call(kind):
                fns[kind][turn[0] % copies](x)
                turn[0] += 1

            for kind in range(3):
                call(kind)  # warm-up
            times = [[], [], []]
            for _ in range(args.rounds):
                for kind in range(3):
                    times[kind].append(timed(lambda: call(kind)))
            ours, plain, sliced = (statistics.median(t) for t in times)
            one_row = ours if one_row is None else one_row
            print(f"{k:>5d}x{n:<5d} {m:5d} {ours:9.4f} {plain:9.4f} {sliced:9.4f} {plain / ours:11.2f}x "
                  f"{sliced / ours:12.2f}x {ours / one_row:9.2f}x", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
