#!/usr/bin/env python
"""quantkit's CPU decode kernels (kernels.cpu_gemv) against PyTorch's packed int4 / int8 kernels,
side by side on the demo model's shapes, at the row counts of decode and speculative verification.

Each (shape, rows) pair times both kernels in alternation (``--rounds`` rounds of ``--calls``
calls each, this machine's speed drifting within minutes) and prints the median ms per call and
the ratio PyTorch / quantkit. Random codes and scales: speed does not depend on the values.

    python scripts/bench_cpu_gemv.py --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

# (in, out) of the demo's fused q/k/v, o, fused gate/up, down, and the LM head
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", default="1,4,9,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args(argv)

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
    print(f"{'weight':6s} {'K x N':>11s} {'rows':>5s} {'quantkit':>9s} {'PyTorch':>9s} {'PyTorch/quantkit':>17s}")
    for bits in (4, 8):
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
