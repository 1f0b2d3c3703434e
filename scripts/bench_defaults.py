#!/usr/bin/env python
"""The measurements behind quantkit's defaults: one variant of one setting at a time, by KL.

Each variant fake-quantizes the demo model in memory through the real pipeline (the exact weights
its packed checkpoint dequantizes to; see tests/test_external_oracle.py) with the scheme and
calibration of docs/defaults.yaml (w4g64 symmetric, 64 x 512 Lee calibration tokens, seed
0 unless the variant says otherwise), and scores it against the original on two held-out texts:
Lee's held-out split (news, all of it: 12 windows of 512) and `--wiki-windows` windows of 512 of
wiki's (Wikipedia). Columns: mean and 99th-percentile KL divergence per token, top-1 agreement,
perplexity, and the calibration time in this process (CPU seconds too: the box is shared).

    python scripts/bench_defaults.py                       # every variant
    python scripts/bench_defaults.py --variants gptq,gptq-mse --wiki-windows 32
"""
from __future__ import annotations

import argparse
import copy
import json
import resource
import time

import torch

# label -> (method, options, scheme overrides, calibration overrides)
VARIANTS = {
    "rtn": ("rtn", {}, {}, {}),
    "rtn-no-mse": ("rtn", {"mse": False}, {}, {}),
    "rtn-exact": ("rtn", {"sym_range": "exact"}, {}, {}),  # AutoAWQ's symmetric grid (absmax/7), range search on
    "gptq": ("gptq", {}, {}, {}),
    "gptq-no-act-order": ("gptq", {"desc_act": False, "static_groups": False}, {}, {}),
    "gptq-no-mse": ("gptq", {"mse": False}, {}, {}),
    "gptq-mse": ("gptq", {"mse": True}, {}, {}),
    "gptq-damp-0.05": ("gptq", {"damp_percent": 0.05}, {}, {}),
    "gptq-128-samples": ("gptq", {}, {}, {"num_samples": 128}),
    "gptaq": ("gptq", {"gptaq": True}, {}, {}),
    "gptaq-mse": ("gptq", {"gptaq": True, "mse": True}, {}, {}),
    "awq": ("awq", {}, {}, {}),
    "awq-centred": ("awq", {"sym_range": "centred"}, {}, {}),  # GPTQ's symmetric grid (absmax/7.5) instead of AutoAWQ's
    "awq-full-grid": ("awq", {"full_grid": True}, {}, {}),
    "awq-duo-both": ("awq", {"duo_scaling": "both"}, {}, {}),  # llm-compressor's: each alpha with and without w_mean
    # calibrated on the outputs of the layers quantized before (the default until 2026-12-02) instead of
    # the unquantized model's hidden states
    "awq-quantized-inputs": ("awq", {"inputs": "quantized"}, {}, {}),
    "awq-mse": ("awq", {"mse": True}, {}, {}),  # the finishing RTN also searches each group's range
    # the attention scale search on 4x, the token-wise one and the clip search on 2x larger samples than the defaults
    "awq-large-sample": ("awq", {"token_search_tokens": 8192, "max_search_tokens": 8192, "clip_search_tokens": 2048},
                         {}, {}),
    # the clip search on 2048 tokens (the scale searches on the previous default's 1024)
    "awq-clip-sample": ("awq", {"token_search_tokens": 1024, "clip_search_tokens": 2048}, {}, {}),
    # the token-wise scale searches (MLP, single linears) on 4096 tokens, the clip search on 1024: the default
    # since 2026-12-03, 4x / 2x the samples before it (awq-small-sample)
    "awq-token-sample": ("awq", {"token_search_tokens": 4096, "clip_search_tokens": 1024}, {}, {}),
    "awq-small-sample": ("awq", {"token_search_tokens": 1024, "clip_search_tokens": 512}, {}, {}),
    # the default's scale sample with a clip sample of 2048
    "awq-token-clip-2048": ("awq", {"token_search_tokens": 4096, "clip_search_tokens": 2048}, {}, {}),
    # only the attention block's scale search on 4x more sequences (the token-wise searches as default)
    "awq-attention-sample": ("awq", {"max_search_tokens": 8192}, {}, {}),
    # the clip search refined toward each row's whole output error (cross terms between groups) or AutoAWQ's
    # per-group choice, on clip samples of 1024, 4096 (the default since 2026-12-05) and 8192 tokens (the
    # search runs from X^T X, so a larger sample costs one product and its capture memory)
    "awq-clip-output": ("awq", {"clip_objective": "output", "clip_search_tokens": 1024}, {}, {}),
    "awq-clip-output-4096": ("awq", {"clip_objective": "output", "clip_search_tokens": 4096}, {}, {}),
    "awq-clip-output-8192": ("awq", {"clip_objective": "output", "clip_search_tokens": 8192}, {}, {}),
    "awq-clip-group": ("awq", {"clip_objective": "group", "clip_search_tokens": 1024}, {}, {}),
    "awq-clip-group-4096": ("awq", {"clip_objective": "group", "clip_search_tokens": 4096}, {}, {}),
    "awq-gptq": ("awq,gptq", {}, {}, {}),
    # also v -> o under GQA, one scale per v row tied across the o columns it feeds (AutoAWQ skips the group)
    "awq-gqa-v-o": ("awq", {"gqa_v_o": True}, {}, {}),
    # twice as fine: alpha in steps of 1/40, clip ratios in steps of 1/40 (same 0.5 reach)
    "awq-fine-alpha": ("awq", {"n_grid": 40}, {}, {}),
    "awq-fine-clip": ("awq", {"clip_n_grid": 40}, {}, {}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=None, help="comma list (default: all): " + ", ".join(VARIANTS))
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--wiki-windows", type=int, default=64)
    ap.add_argument("--asym", action="store_true", help="asymmetric 4-bit instead of symmetric")
    ap.add_argument("--json-out", default=None, help="append each row as a JSON line to this file")
    args = ap.parse_args()

    from quantkit import data
    from quantkit.api import linear_shapes
    from quantkit.baseline_cache import in_memory_baseline
    from quantkit.models import get_adapter
    from quantkit.pipeline import quantize_model
    from quantkit.quantizers.recipe import build_recipe
    from quantkit.scheme import QuantScheme
    from quantkit.scoring import compare, logits_of, windows_of
    from quantkit.sources import load_source_model

    original, tok, *_ = load_source_model("demo", dtype=torch.float32)
    held_out = {"lee": windows_of(data.eval_token_stream("lee", tok), 512, None),
                "wiki": windows_of(data.eval_token_stream("wiki", tok), 512, args.wiki_windows)}
    baselines = {name: in_memory_baseline(original, w) for name, w in held_out.items()}
    print("held-out tokens: " + ", ".join(f"{n} {sum(int(x.numel()) for x in w)}" for n, w in held_out.items()))
    rows = []
    for label in (args.variants.split(",") if args.variants else VARIANTS):
        method, options, scheme_over, cal_over = VARIANTS[label]
        recipe = build_recipe(method, options)
        model = copy.deepcopy(original)
        scheme = QuantScheme(**{"bits": 4, "group_size": 64, "sym": not args.asym, **scheme_over})
        schemes = scheme.resolve(linear_shapes(model))
        cal = {"num_samples": args.num_samples, "seq_len": args.seq_len, **cal_over}
        ids = (data.calibration_batches("lee", tok, seed=0, **cal) if recipe.needs_calibration else None)
        cpu0, t0 = _cpu_s(), time.perf_counter()
        quantize_model(model, get_adapter(model), recipe, schemes, ids, progress=False,
                       batch_size=cal["num_samples"])
        row = {"variant": label, "method": method, "options": options, "sym": not args.asym, **cal,
               "quantize_s": round(time.perf_counter() - t0, 1), "quantize_cpu_s": round(_cpu_s() - cpu0, 1)}
        for name, windows in held_out.items():
            r = compare(logits_of(model), baselines[name], windows, batch_size=4)
            # a standard error is None over a single window
            row[name] = {k: None if r[k] is None else round(r[k], 5)
                         for k in ("kl_mean", "kl_mean_stderr", "kl_p99", "top1_agreement", "perplexity",
                                   "baseline_perplexity", "ln_ppl_ratio_stderr")}
        del model
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json_out:
            with open(args.json_out, "a") as f:
                f.write(json.dumps(row) + "\n")
    print_table(rows)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def print_table(rows: list[dict]) -> None:
    ref = next((r for r in rows if r["variant"] == "gptq"), None)
    print("\n| variant | lee KL | lee p99 | lee top-1 | lee ppl | wiki KL | wiki p99 | wiki top-1 | wiki ppl | "
          "KL vs gptq (lee / wiki) | quantize s (CPU s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lee, wiki = r["lee"], r["wiki"]
        ratio = (f"{lee['kl_mean'] / ref['lee']['kl_mean']:.2f} / {wiki['kl_mean'] / ref['wiki']['kl_mean']:.2f}"
                 if ref else "-")
        print(f"| {r['variant']} | {lee['kl_mean']:.4f} | {lee['kl_p99']:.3f} | {lee['top1_agreement']:.3f} | "
              f"{lee['perplexity']:.2f} | {wiki['kl_mean']:.4f} | {wiki['kl_p99']:.3f} | {wiki['top1_agreement']:.3f} | "
              f"{wiki['perplexity']:.2f} | {ratio} | {r['quantize_s']} ({r['quantize_cpu_s']}) |")
    if rows:
        print(f"\noriginal perplexity: lee {rows[0]['lee']['baseline_perplexity']:.2f}, "
              f"wiki {rows[0]['wiki']['baseline_perplexity']:.2f}")


if __name__ == "__main__":
    main()
