#!/usr/bin/env python
"""How should MoE experts be calibrated? `--moe-calibration routed` against `all`, measured.

Each policy quantizes the same MoE model (GPTQ, same Lee calibration tokens) and the checkpoint is scored
against the original on held-out Lee and wiki text: KL divergence of the next-token distribution per token
(mean) and top-1 agreement, llama.cpp's --kl-divergence measure (quantkit eval). Policies:
    routed:N   each expert on the tokens routed to it; one with fewer than N falls back to RTN
    all        every token through every expert (the block's output stays the routed one)
Models (scripts/moe_models.py): `random` (a random Qwen3-MoE shape: 8 layers, 16 experts, top-2),
`moefied` (the demo SmolLM2-135M split into a Qwen2-MoE: a shared expert of its most important neurons,
routed experts of co-activating trained neurons, a least-squares router; uneven, content-driven loads)
and `upcycled` (a top-2 Mixtral of perturbed copies of the demo's MLPs: every expert alike, too big for
a 2-core box at 16 experts). Few calibration tokens make some experts starve, which is where policies
differ.

    nice python scripts/moe_calibration_policy.py --model random --policies routed:8,routed:64,all
    nice python scripts/moe_calibration_policy.py --model moefied --experts 12 --top-k 4 --policies routed:8,all
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_models import moefied_qwen2_moe, random_qwen3_moe, upcycled_mixtral  # noqa: E402


def policy_args(policy: str) -> dict:
    if policy == "all":
        return {"moe_calibration": "all"}
    mode, _, n = policy.partition(":")
    if mode != "routed" or not n.isdigit():
        raise SystemExit(f"policy {policy!r}: use all or routed:N")
    return {"moe_calibration": "routed", "moe_min_tokens": int(n)}


def make_model(kind: str, work: Path, args) -> Path:
    from quantkit.assets import demo_model_dir

    demo = Path(demo_model_dir())
    if kind == "random":
        return random_qwen3_moe(work / "random-moe", tokenizer_from=demo, experts=args.experts, top_k=args.top_k)
    if kind == "moefied":
        return moefied_qwen2_moe(work / "moefied-moe", dense=demo, experts=args.experts, top_k=args.top_k)
    return upcycled_mixtral(work / "upcycled-moe", dense=demo, experts=args.experts, top_k=args.top_k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["random", "moefied", "upcycled"], default="random")
    ap.add_argument("--policies", default="routed:1,routed:8,routed:64,all")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--score-on", default="lee,wiki", help="held-out datasets scored (comma-separated)")
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--max-windows", type=int, default=16, help="held-out windows of --seq-len tokens scored")
    args = ap.parse_args()

    import quantkit

    datasets = args.score_on.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source = make_model(args.model, work, args)
        for policy in args.policies.split(","):
            out = work / policy.replace(":", "-")
            summary = quantkit.quantize(str(source), "gptq", bits=args.bits, group_size=args.group_size, output=out,
                                        num_samples=args.num_samples, seq_len=args.seq_len, progress=False,
                                        **policy_args(policy))
            layers = summary["moe"]["layers"].values()
            row = {"policy": policy, "quantize_s": summary["seconds"],
                   "tokens_min": min(r["tokens_min"] for r in layers),
                   "tokens_median": sorted(r["tokens_median"] for r in layers)[len(layers) // 2],
                   "uncalibrated": sum(len(r["uncalibrated"]) for r in layers)}
            for name in datasets:
                score = quantkit.evaluate(out, baseline=str(source), dataset=name, seq_len=args.seq_len,
                                          max_windows=args.max_windows, baseline_cache=False)
                row[name] = {"kl_mean": score["kl_mean"], "kl_p99": score["kl_p99"], "top1": score["top1_agreement"],
                             "tokens": score.get("tokens")}
            rows.append(row)
    print(f"model {args.model}, {args.experts} experts top-{args.top_k}, GPTQ w{args.bits}g{args.group_size}, calibration "
          f"{args.num_samples}x{args.seq_len} Lee tokens, scored on up to {args.max_windows}x{args.seq_len} held-out "
          f"tokens of {', '.join(datasets)}")
    cols = "".join(f" {name + ' KL':>10} {'p99':>7} {'top-1':>7}" for name in datasets)
    print(f"{'policy':<11}{cols} {'min tok':>8} {'med tok':>8} {'uncal.':>7} {'quant s':>8}")
    for r in rows:
        cells = "".join(f" {r[n]['kl_mean']:>10.5f} {r[n]['kl_p99']:>7.4f} {r[n]['top1']:>7.4f}" for n in datasets)
        print(f"{r['policy']:<11}{cells} {r['tokens_min']:>8} {r['tokens_median']:>8} {r['uncalibrated']:>7} "
              f"{r['quantize_s']:>8.1f}")
    print(json.dumps({"model": args.model, "rows": rows}))


if __name__ == "__main__":
    main()
