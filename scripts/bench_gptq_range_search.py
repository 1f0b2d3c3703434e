#!/usr/bin/env python
"""What GPTQ's range search (option mse) costs in the solve, side by side on the demo's layer shapes.

Why this exists: the vLLM tier (tests/test_vllm.py) writes its non-default GPTQ layouts without the range
search, which changes the scales GPTQ picks but not the layout vLLM reads, to save CI time; this prints
how much time that saves. One decoder layer of SmolLM2-135M: q/k/v stacked [960, 576], o [576, 576],
gate/up stacked [3072, 576], down [576, 1536]; 4-bit, group 64, symmetric, act-order; random weights and a
Hessian from random inputs of unequal scales (the solve's cost does not depend on the values). Each
variant runs --rounds times, alternating, and the best time counts, so a busy machine hurts all alike.

    python scripts/bench_gptq_range_search.py [--rounds 2]
"""
from __future__ import annotations

import argparse
import time

import torch

from quantkit.quantizers.gptq_core import gptq_quantize

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in] of one demo layer's solves
VARIANTS = {"static groups": dict(static_groups=True), "dynamic groups": dict(static_groups=False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    problems = []
    for n, k in SHAPES:
        x = torch.randn(1024, k) * torch.linspace(0.2, 3, k)
        problems.append((torch.randn(n, k) * 0.02, 2 / 1024 * x.t() @ x))
    best: dict[tuple[str, bool], float] = {}
    for _ in range(args.rounds):
        for name, kw in VARIANTS.items():
            for mse in (True, False):
                t0 = time.perf_counter()
                for w, h in problems:
                    gptq_quantize(w, h, 4, 64, True, act_order=True, mse=mse, **kw)
                took = time.perf_counter() - t0
                best[(name, mse)] = min(took, best.get((name, mse), took))
    for name in VARIANTS:
        on, off = best[(name, True)], best[(name, False)]
        print(f"{name:15s} one layer: mse on {on:.2f} s, off {off:.2f} s: {on / off:.1f}x "
              f"(30 layers: {30 * on:.0f} s against {30 * off:.0f} s)")


if __name__ == "__main__":
    main()
