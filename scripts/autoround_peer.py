#!/usr/bin/env python
"""Run auto-round (Intel's SignRound) on the same model, scheme and calibration tokens as quantkit.

Why this exists: `scripts/bench_quality.py` compares quantkit's recipes against the other tools on
held-out KL. This script is auto-round's *benchmark peer only*: it runs under a separate venv where
`auto-round` is installed, never imports the quantkit package (only quantkit/memory.py through
peer_common, stdlib-only, so every tool's peak RSS is measured alike), and auto-round is never a
dependency of quantkit. The calibration token ids come from the safetensors file bench_quality.py
writes with quantkit's own data pipeline (key "input_ids", int64 [num_samples, seq_len]); they are
handed to auto-round as its dataloader, one sequence per item, in that order.

auto-round's settings are its own defaults except those named: W4A16 with --bits/--group-size and
symmetric unless --asym, --iters (its default 200; 50 is its "light" setting), --nsamples/--seqlen =
the calibration set's shape, its training batch of --batch-size (its default 8). The model is loaded in
float32 and run on the CPU. The checkpoint is exported in auto-round's "auto_gptq" format (GPTQ
packing), which quantkit's loader reads. The last stdout line is one JSON object; "seconds" is the
quantize-and-save call only.

Creating the venv (its pins clash with quantkit's: never install auto-round into quantkit's venv);
/etc/xdg/pip/constraints.txt caps torch, and torch 2.13.0 comes from the local CPU wheel:
    python3 -m venv /work/autoround-venv
    /work/autoround-venv/bin/pip install torch==2.13.0+cpu auto-round==0.16.1
  (brings transformers 5.25.0, accelerate 1.16.0)

    /work/autoround-venv/bin/python scripts/autoround_peer.py --iters 50 \\
        --model ~/.cache/quantkit/smollm2-135m-instruct --calib-ids calib_ids.safetensors \\
        --output /work/peer-out/autoround-light
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from peer_common import load_calibration_ids, peak_rss_mb


def saved_scheme(folder: Path) -> dict:
    """What the saved checkpoint declares (config.json quantization_config), so the row states what ran."""
    qc = json.loads((folder / "config.json").read_text()).get("quantization_config", {})
    keys = ("quant_method", "bits", "group_size", "sym", "desc_act", "iters", "nsamples", "seqlen", "batch_size",
            "autoround_version", "packing_format", "checkpoint_format")
    return {k: qc.get(k) for k in keys if k in qc}


def flatten_saved(out: Path) -> None:
    """auto-round 0.16.1's immediate-saving mode writes into OUTPUT/<model>-w<bits>g<group>/, not OUTPUT: move
    that one folder's files up, so OUTPUT is the checkpoint as with earlier versions."""
    if (out / "config.json").is_file():
        return
    inner = [d for d in out.iterdir() if d.is_dir() and (d / "config.json").is_file()]
    if len(inner) != 1:
        raise SystemExit(f"auto-round saved no checkpoint folder in {out} (found {[d.name for d in inner]})")
    for f in inner[0].iterdir():
        f.rename(out / f.name)
    inner[0].rmdir()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model folder")
    ap.add_argument("--calib-ids", required=True, help='safetensors file with "input_ids" int64 [num_samples, seq_len]')
    ap.add_argument("--output", required=True)
    ap.add_argument("--method", default="signround", choices=["signround"], help="(one method; for bench_quality)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200, help="auto-round's default 200; 50 is its light setting")
    ap.add_argument("--batch-size", type=int, default=8, help="auto-round's training batch (its default 8)")
    sym = ap.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=True, help="symmetric weights (default)")
    sym.add_argument("--asym", dest="sym", action="store_false", help="asymmetric weights (zero point)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import auto_round
    from auto_round import AutoRound

    t_total = time.perf_counter()
    ids = load_calibration_ids(args.calib_ids)
    num_samples, seq_len = ids.shape
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, device_map=None)
    model.eval()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rounder = AutoRound(model, tokenizer=tokenizer, scheme="W4A16", bits=args.bits, group_size=args.group_size,
                        sym=args.sym, dataset=[ids[i:i + 1] for i in range(num_samples)], iters=args.iters,
                        nsamples=num_samples, seqlen=seq_len, batch_size=args.batch_size, device_map="cpu")
    rounder.quantize_and_save(output_dir=str(out), format="auto_gptq")
    seconds = time.perf_counter() - t0
    flatten_saved(out)
    print(json.dumps({"seconds": round(seconds, 2), "total_seconds": round(time.perf_counter() - t_total, 2),
                      "peak_rss_mb": round(peak_rss_mb(), 1), "version": auto_round.__version__,
                      "method": "signround", "iters": args.iters, "scheme": saved_scheme(out),
                      "num_samples": num_samples, "seq_len": seq_len, "model_dtype": "float32"}))


if __name__ == "__main__":
    main()
