#!/usr/bin/env python
"""Where a batch-1 decode step's wall time goes in quantkit's engine: the projections (every call
of a layer's q/k/v, o, gate/up and down matmuls), the LM head, and the rest of the forward (norms,
rotary, KV writes, attention, residuals), per decode step; where the engine runs all layers in one
C call (engine.c_decode_step), that call, the LM head and the rest.

Timers wrap the runner's resolved callables (``ModelRunner.plans``, ``head``), so what is
measured is the engine's own path; only decode steps are counted. Each run generates
``--new-tokens`` tokens from the same prompt (EOS ignored) after a warm-up.

    python scripts/profile_decode_step.py --model ./ckpt-w4g64 --dtype bfloat16
    python scripts/profile_decode_step.py --model demo --runs 3
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="quantized checkpoint, HF folder or demo")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default=None, help="activation dtype (default: quantkit.load's)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--lm-head-quant", default=None, help="int8 or int4: the LM head through a quantized copy")
    args = ap.parse_args(argv)

    import torch

    import quantkit
    from quantkit.engine import LLMEngine, SamplingParams

    model = quantkit.load(args.model, backend=args.backend, device=args.device, dtype=args.dtype)
    engine = LLMEngine(model, None, num_kv_blocks=-(-(args.prompt_len + args.new_tokens) // 16) + 2, max_num_seqs=1,
                       lm_head_quant=args.lm_head_quant)
    runner = engine.runner
    cuda = runner.device.type == "cuda"
    totals = {"projections": 0.0, "c_layers": 0.0, "lm_head": 0.0, "forward": 0.0, "step": 0.0}
    state = {"decode": False, "steps": 0}

    def timed(fn, key):
        if fn is None:
            return None

        def call(*a):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*a)
            if cuda:
                torch.cuda.synchronize()
            if state["decode"]:
                totals[key] += time.perf_counter() - t0
            return out
        return call

    names = ("qkv", "q", "k", "v", "o", "gate_up", "gate", "up", "down")
    runner.plans = [dataclasses.replace(p, **{n: timed(getattr(p, n), "projections") for n in names})
                    for p in runner.plans]
    runner.head = timed(runner.head, "lm_head")
    runner.forward = timed(runner.forward, "forward")
    c_step = runner.c_step is not None  # every layer in one C call (engine.c_decode_step)
    if c_step:
        runner.c_step = timed(runner.c_step, "c_layers")
        runner._c_forward = timed(runner._c_forward, "forward")
    run = runner.run

    def run_step(seqs, is_prefill):
        state["decode"] = not is_prefill
        t0 = time.perf_counter()
        out = run(seqs, is_prefill)
        if not is_prefill:
            totals["step"] += time.perf_counter() - t0
            state["steps"] += 1
        state["decode"] = False
        return out
    runner.run = run_step

    prompt = torch.randint(100, 1000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    engine.generate([prompt[:8]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
    print(f"{args.model} ({runner.dtype}, {runner.num_layers} layers, device {runner.device}, "
          f"{torch.get_num_threads()} threads): ms per decode step", file=sys.stderr)
    for _ in range(args.runs):
        for key in totals:
            totals[key] = 0.0
        state["steps"] = 0
        engine.generate([prompt], params)
        ms = {k: v / state["steps"] * 1e3 for k, v in totals.items()}
        if c_step:
            print(f"step {ms['step']:6.1f} = all layers in C {ms['c_layers']:5.1f} + rest of forward (embedding, "
                  f"rotary, final norm) {ms['forward'] - ms['c_layers']:5.1f} + LM head {ms['lm_head']:5.1f} + other "
                  f"{ms['step'] - ms['forward'] - ms['lm_head']:4.1f}")
            continue
        print(f"step {ms['step']:6.1f} = projections {ms['projections']:5.1f} + rest of forward "
              f"{ms['forward'] - ms['projections']:5.1f} + LM head {ms['lm_head']:5.1f} + other "
              f"{ms['step'] - ms['forward'] - ms['lm_head']:4.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
