#!/usr/bin/env python
"""Float presets side by side (#47): quantkit's RTN and GPTQ against llm-compressor's, one run.

For each preset (default NVFP4A16 and MXFP4A16), four checkpoints of the same model on the same calibration
token ids (quantkit's own pipeline, `lee`, seed 0, written once to WORKDIR/calib_ids.safetensors for the peer):
  quantkit rtn   `quantkit.float_checkpoint.write(method="rtn")`
  quantkit gptq  `quantkit.float_checkpoint.write(method="gptq")` (GPTQ on the preset's grid, act-order,
                 quantkit's layer-by-layer pipeline)
  llmc rtn       llm-compressor's QuantizationModifier(scheme=PRESET)   (scripts/llmcompressor_peer.py)
  llmc gptq      llm-compressor's GPTQModifier(scheme=PRESET), dampening 0.01, block 128, its default act-order
  quantkit smoothquant[+gptq]   SmoothQuant's pass first (presets with quantized activations), then RTN or GPTQ
each in its own subprocess; "seconds" is the quantization call alone (model loading excluded) for both tools,
"cpu_seconds" that call's CPU time (all threads; far less inflated than wall time by a busy machine), "cpu_s" the
whole child's (load and save included).
quantkit's rows take options (`--quantkit-options JSON`, or per row: "quantkit rtn mse=false" is RTN on the
absmax scales, without the range search of `float_codecs.scale_search`).
Every checkpoint is scored by `quantkit eval --baseline MODEL` on held-out `lee` and `wiki` windows (the
same loader for both tools' folders; its logits equal a transformers forward on compressed-tensors'
decompressed weights, tests/test_float_runtime.py): mean KL to the original model per token, top-1
agreement, perplexity.

    python scripts/bench_float_schemes.py --workdir /tmp/qk-float \\
        --llmcompressor-python /work/peer-venv/bin/python --presets NVFP4A16,MXFP4A16
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_quantize import quantkit_cli, run, write_calibration_ids  # noqa: E402


def quantize_with_quantkit(model_folder: str, preset_name: str, method: str, calib_ids: str, output: str,
                           options: dict) -> None:
    """Child process: one quantkit checkpoint; prints a JSON line."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.float_checkpoint import write
    from quantkit.pipeline import calibration_batch_size
    from quantkit.plan import resolve_plan
    from quantkit.scheme_presets import preset

    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    ids = load_file(calib_ids)["input_ids"]
    # the sequences per calibration forward `quantkit quantize` picks for this run (api._calibration_set): all 64
    # in one forward for GPTQ (the one-pass strategy), so the row times what a user runs
    plan = resolve_plan(method.replace("+", ","), scheme=preset_name, options=options or None)
    batch = calibration_batch_size(model.config, plan.recipe, ids.shape[0], ids.shape[1])
    t0, c0 = time.perf_counter(), time.process_time()
    p = preset(preset_name)  # RTN reads the calibration ids only for static input scales (FP8, NVFP4)
    write(model, p, output, method=method, calibration=ids if method != "rtn" or p.calibrates_activations else None,
          options=options or None, batch_size=batch)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    AutoTokenizer.from_pretrained(model_folder).save_pretrained(output)
    print(json.dumps({"seconds": round(seconds, 2), "cpu_seconds": round(cpu_seconds, 2), "batch_size": batch}))


def weight_errors(model_name: str, presets: list[str]) -> None:
    """No data, no scoring: for each preset, the squared weight error of round-to-nearest summed over the
    model's quantized linears, with the range search (`mse`) and without it, and both RTN's CPU seconds (one
    process, the same weights). A proxy only: the KL rows above decide the defaults."""
    import re

    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.float_checkpoint import DEFAULT_IGNORE, quantize_weight
    from quantkit.scheme_presets import preset
    from quantkit.sources import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(model_name), dtype=torch.float32).eval()
    linears = [(n, m.weight.detach()) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and not any(re.search(p, n) for p in DEFAULT_IGNORE)]
    for name in presets:
        err, cpu = {}, {}
        for search in (False, True):
            c0, total = time.process_time(), 0.0
            for _, w in linears:
                _, w_hat = quantize_weight(w, preset(name), search=search)
                total += float((w_hat - w).double().square().sum())
            err[search], cpu[search] = total, time.process_time() - c0
        print(json.dumps({"preset": name, "weight_sq_error_absmax": err[False], "weight_sq_error_search": err[True],
                          "ratio": round(err[True] / err[False], 4), "cpu_s_absmax": round(cpu[False], 1),
                          "cpu_s_search": round(cpu[True], 1), "linears": len(linears)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--presets", default="NVFP4A16,MXFP4A16")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lee-windows", type=int, default=None, help="held-out windows of 512 (default: all of lee's)")
    ap.add_argument("--wiki-windows", type=int, default=32)
    ap.add_argument("--rows", default="llmc rtn,quantkit rtn,llmc gptq,quantkit gptq",
                    help='comma list of rows; a quantkit row may add options, "quantkit rtn mse=false"')
    ap.add_argument("--llmcompressor-python", default=None)
    ap.add_argument("--quantkit-options", default="{}",
                    help='JSON options for quantkit\'s rows, e.g. \'{"mse": false}\' (scales without the range search)')
    ap.add_argument("--workdir", default="/tmp/qk-float")
    ap.add_argument("--weight-error", action="store_true",
                    help="only the RTN weight error with and without the range search per preset (no peer, no eval)")
    ap.add_argument("--run-quantkit", nargs=4, metavar=("PRESET", "METHOD", "CALIB_IDS", "OUTPUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_quantkit:
        quantize_with_quantkit(args.model, *args.run_quantkit, json.loads(args.quantkit_options))
        return
    if args.weight_error:
        weight_errors(args.model, [p.strip().upper() for p in args.presets.split(",")])
        return
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    calib_ids = work / "calib_ids.safetensors"
    folder = write_calibration_ids(args.model, args.num_samples, args.seq_len, calib_ids)
    rows = []
    t_all = time.perf_counter()
    for name in [p.strip().upper() for p in args.presets.split(",")]:
        for tool, method, *extra in (r.strip().split() for r in args.rows.split(",")):
            # a quantkit row may name options of its own after the method: "quantkit rtn mse=false"
            options = {**json.loads(args.quantkit_options), **{k: json.loads(v) for k, v in (e.split("=", 1) for e in extra)}}
            out = work / "-".join([tool, method, *extra, name])
            if tool == "quantkit":
                cmd = [sys.executable, __file__, "--model", folder, "--quantkit-options", json.dumps(options),
                       "--run-quantkit", name, method, str(calib_ids), str(out)]
            elif args.llmcompressor_python:
                cmd = [args.llmcompressor_python, str(HERE / "llmcompressor_peer.py"), "--method", method, "--scheme", name,
                       "--model", folder, "--calib-ids", str(calib_ids), "--output", str(out)]
            else:
                print(f"{tool} {method} {name}: left out (no --llmcompressor-python)")
                continue
            if out.exists():
                sys.exit(f"{out} exists; use a fresh --workdir")
            result, wall = run(cmd)
            # cpu_s: the child's user + sys seconds (model load included), which a busy machine inflates far less
            row = {"preset": name, "row": " ".join([tool, method, *extra]), "path": str(out), "seconds": result["seconds"],
                   "cpu_seconds": result.get("cpu_seconds"), "cpu_s": result["_cpu_s"]}
            if tool == "quantkit":
                row["options"], row["batch_size"] = options, result.get("batch_size")
            for dataset, windows in (("lee", args.lee_windows), ("wiki", args.wiki_windows)):
                r, _ = run(quantkit_cli("eval", "--model", str(out), "--baseline", folder, "--dataset", dataset,
                                        "--backend", "reference", "--json",
                                        *(["--max-windows", str(windows)] if windows else [])))
                row[dataset] = {k: r.get(k) for k in ("kl_mean", "kl_mean_stderr", "top1_agreement", "perplexity",
                                                      "baseline_perplexity", "tokens")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"calibration: {args.num_samples} x {args.seq_len} Lee tokens, seed 0, identical ids for both tools; "
          f"{time.perf_counter() - t_all:.0f} s in all")
    print(f"{'preset':10} {'row':24} {'KL lee':>8} {'KL wiki':>8} {'KL mean':>8} {'top1 lee':>8} {'ppl wiki':>8} {'s':>7}")
    for r in rows:
        mean = (r["lee"]["kl_mean"] + r["wiki"]["kl_mean"]) / 2
        print(f"{r['preset']:10} {r['row']:24} {r['lee']['kl_mean']:8.4f} {r['wiki']['kl_mean']:8.4f} {mean:8.4f} "
              f"{r['lee']['top1_agreement']:8.3f} {r['wiki']['perplexity']:8.2f} {r['seconds']:7.1f}")
    by = {(r["preset"], r["row"]): r for r in rows}
    for name in {r["preset"] for r in rows}:
        for method in ("rtn", "gptq", "smoothquant", "smoothquant+gptq"):
            a, b = by.get((name, f"quantkit {method}")), by.get((name, f"llmc {method}"))
            if a and b:
                ka = (a["lee"]["kl_mean"] + a["wiki"]["kl_mean"]) / 2
                kb = (b["lee"]["kl_mean"] + b["wiki"]["kl_mean"]) / 2
                lee, wiki = (a[d]["kl_mean"] / b[d]["kl_mean"] for d in ("lee", "wiki"))
                print(f"{name} {method}: quantkit / llm-compressor KL lee {lee:.3f}, wiki {wiki:.3f}, mean {ka / kb:.3f}; "
                      f"time {a['seconds'] / b['seconds']:.2f}")


if __name__ == "__main__":
    main()
